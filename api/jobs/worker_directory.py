"""Reads the worker registry: which models have live workers, and whether a given worker lives."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.contract import CONTRACT_VERSION
from shared.errors import ErrorKind, RelayError
from shared.job_lifecycle import JobRecord
from shared.redis_keys import MODEL_FORGET_AFTER_S, RedisKeys
from shared.redis_replies import texts
from shared.registry import ModelRecord, WorkerInfo

# A positive answer is reused this long, so a busy API does not read the registry per request.
LIVE_ANSWER_REUSE_S = 0.5


class WorkerDirectory:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        self._live_cache: dict[str, float] = {}
        # One registry read per model at a time: a burst of requests shares it instead of each
        # opening a Redis connection for the same answer.
        self._live_lookups: dict[str, asyncio.Task[bool]] = {}
        # Model → the newest job contract version all its live workers read, from the last lookup.
        self._readable_versions: dict[str, int] = {}

    async def live_workers(self, model: str) -> list[WorkerInfo]:
        ids = sorted(texts(await self._redis.smembers(self._keys.model_workers(model))))
        if not ids:
            return []
        records = await self._redis.mget([self._keys.worker(worker_id) for worker_id in ids])
        dead = [worker_id for worker_id, raw in zip(ids, records, strict=True) if raw is None]
        if dead:
            await self._redis.srem(self._keys.model_workers(model), *dead)
        return [WorkerInfo.model_validate_json(raw) for raw in records if raw is not None]

    async def model_records(self) -> list[ModelRecord]:
        raw = await self._redis.hgetall(self._keys.models())
        return [ModelRecord.model_validate_json(value) for value in raw.values()]

    async def model_record(self, model: str) -> ModelRecord | None:
        raw = await self._redis.hget(self._keys.models(), model)
        return ModelRecord.model_validate_json(raw) if raw is not None else None

    async def takes_images(self, model: str) -> bool:
        """Whether the model is a vision-language model (its workers say so in its record)."""
        try:
            record = await self.model_record(model)
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        return record is not None and record.vision

    async def queue_depth(self, model: str) -> int:
        """Interactive jobs queued or running for the model (what its queue limit counts)."""
        queue = self._keys.queue(model)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(queue)
            pipe.zcard(self._keys.queue_running(queue))
            queued, running = await pipe.execute()
        return int(queued) + int(running)

    async def is_owner_alive(self, record: JobRecord) -> bool:
        return (await self.live_owners([record]))[record.job_id]

    async def live_owners(self, records: list[JobRecord]) -> dict[str, bool]:
        """Job id → whether the worker process that claimed it still heartbeats. A worker restarted
        under the same id is another process (another instance): its predecessor's jobs are orphans."""
        worker_ids = sorted({record.owner for record in records if record.owner})
        raw = await self._redis.mget([self._keys.worker(w) for w in worker_ids]) if worker_ids else []
        instances = {w: WorkerInfo.model_validate_json(r).instance for w, r in zip(worker_ids, raw, strict=True) if r}
        return {
            record.job_id: record.owner is not None and instances.get(record.owner) == record.owner_instance
            for record in records
        }

    async def has_live_worker(self, model: str, fresh: bool = False) -> bool:
        """``fresh``: read the registry now, not the answer reused for ``LIVE_ANSWER_REUSE_S``
        (deciding a job's fate must not trust a worker that died within the last half second)."""
        now = time.monotonic()
        if not fresh and self._live_cache.get(model, 0.0) > now:
            return True
        lookup = self._live_lookups.get(model)
        if lookup is None:
            lookup = asyncio.create_task(self._look_up_live(model))
            self._live_lookups[model] = lookup
            lookup.add_done_callback(lambda _: self._live_lookups.pop(model, None))
        # shield: one caller giving up (its client left) must not cancel the others' answer.
        return await asyncio.shield(lookup)

    async def _look_up_live(self, model: str) -> bool:
        workers = await self.live_workers(model)
        if workers:
            self._live_cache[model] = time.monotonic() + LIVE_ANSWER_REUSE_S
            self._readable_versions[model] = min(min(w.contract_version for w in workers), CONTRACT_VERSION)
        return bool(workers)

    async def readable_version(self, model: str) -> int:
        """The job contract version to write for ``model``: the newest that every live worker of
        it reads (older during a rolling upgrade), read with the liveness answer."""
        await self.has_live_worker(model)
        return self._readable_versions.get(model, CONTRACT_VERSION)

    async def require_live_worker(self, model: str) -> None:
        """404 for a model never served here, 503 for one whose workers are all gone."""
        try:
            if await self.has_live_worker(model):
                return
            raw = await self._redis.hget(self._keys.models(), model)
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        if raw is None or time.time() - ModelRecord.model_validate_json(raw).last_seen > MODEL_FORGET_AFTER_S:
            raise RelayError(
                ErrorKind.MODEL_NOT_FOUND, f"The model `{model}` does not exist or is not served here.", "model"
            )
        raise RelayError(
            ErrorKind.NO_LIVE_WORKER,
            f"No live worker serves model `{model}` right now; start one or retry later.",
            "model",
        )
