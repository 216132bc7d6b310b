"""Reads the worker registry: which models have live (ready) or loading workers, and whether a
given worker lives."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.adapters import AdapterRecord, AdapterStore
from shared.contract import CONTRACT_VERSION
from shared.errors import ErrorKind, RelayError
from shared.job_lifecycle import JobRecord
from shared.redis_keys import MODEL_FORGET_AFTER_S, RedisKeys
from shared.redis_replies import texts
from shared.registry import ModelRecord, WorkerInfo

# A reading with a ready worker is reused this long, so a busy API does not read the registry per request.
LIVE_ANSWER_REUSE_S = 0.5
# A worker that reports holding no job this long after the last write under its claim of a job
# that is still running has forgotten that job: a Redis failover lost the write that ended it (or
# handed it back). Its claim is then no longer alive, and the job is settled as an orphan.
FORGOTTEN_AFTER_S = 5.0


@dataclass(frozen=True)
class ModelWorkers:
    """One reading of a model's workers. Live means ready to take requests: a loading worker
    claims no job yet, a draining one no new job, and a batch-only one (``--lanes batch``) batch
    lines alone (they wait for such a worker, however long: a batch pool may scale to zero)."""

    workers: tuple[WorkerInfo, ...] = ()

    @property
    def ready(self) -> list[WorkerInfo]:
        return [worker for worker in self.workers if worker.state == "ready" and worker.lanes != "batch"]

    @property
    def loading(self) -> list[WorkerInfo]:
        return [worker for worker in self.workers if worker.state == "loading" and worker.lanes != "batch"]

    @property
    def readable_version(self) -> int:
        """The newest job contract version that every worker of the model reads (older during a
        rolling upgrade); loading workers count, since they claim the model's jobs once ready."""
        return min([CONTRACT_VERSION, *(worker.contract_version for worker in self.workers)])

    @property
    def refuses_images(self) -> bool:
        """A ready worker says the model takes no images. A loading worker has not said yet: with
        none ready nothing is refused here, and the worker that claims the job answers as any
        ready worker does."""
        ready = self.ready
        return bool(ready) and not any(worker.vision for worker in ready)


class WorkerDirectory:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        self.adapters = AdapterStore(redis, keys)
        # Model → (reusable until, a reading with a ready worker).
        self._reusable: dict[str, tuple[float, ModelWorkers]] = {}
        # One registry read per model at a time: a burst of requests shares it instead of each
        # opening a Redis connection for the same answer.
        self._lookups: dict[str, asyncio.Task[ModelWorkers]] = {}

    async def workers(self, model: str) -> list[WorkerInfo]:
        """Every worker of ``model`` whose heartbeat has not expired, in any state."""
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

    async def refuses_images(self, model: str) -> bool:
        """Whether a ready worker of the model says it takes no images (see ``ModelWorkers``)."""
        try:
            return (await self.model_workers(model)).refuses_images
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc

    async def queue_depth(self, model: str) -> int:
        """Interactive jobs queued or running for the model (what its queue limit counts)."""
        queue = self._keys.queue(model)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(queue)
            pipe.zcard(self._keys.queue_running(queue))
            queued, running = await pipe.execute()
        return int(queued) + int(running)

    async def backlog(self, model: str) -> tuple[int, int]:
        """The model's jobs queued and not yet claimed: interactive, then batch lines."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self._keys.queue(model))
            pipe.zcard(self._keys.batch_queue(model))
            interactive, batch = await pipe.execute()
        return int(interactive), int(batch)

    async def is_owner_alive(self, record: JobRecord) -> bool:
        return (await self.live_owners([record]))[record.job_id]

    async def live_owners(self, records: list[JobRecord]) -> dict[str, bool]:
        """Job id → whether the worker process that claimed it still heartbeats and holds it. A
        worker restarted under the same id is another process (another instance): its
        predecessor's jobs are orphans; so are the jobs of a worker that says it holds none."""
        worker_ids = sorted({record.owner for record in records if record.owner})
        raw = await self._redis.mget([self._keys.worker(w) for w in worker_ids]) if worker_ids else []
        owners = {w: WorkerInfo.model_validate_json(r) for w, r in zip(worker_ids, raw, strict=True) if r}
        return {
            record.job_id: record.owner is not None and _holds(owners.get(record.owner), record) for record in records
        }

    async def model_workers(self, model: str, fresh: bool = False) -> ModelWorkers:
        """``fresh``: read the registry now, not a reading reused for ``LIVE_ANSWER_REUSE_S``
        (deciding a job's fate must not trust a worker that died within the last half second)."""
        reusable = self._reusable.get(model)
        if not fresh and reusable is not None and reusable[0] > time.monotonic():
            return reusable[1]
        lookup = self._lookups.get(model)
        if lookup is None:
            lookup = asyncio.create_task(self._look_up(model))
            self._lookups[model] = lookup
            lookup.add_done_callback(lambda _: self._lookups.pop(model, None))
        # shield: one caller giving up (its client left) must not cancel the others' answer.
        return await asyncio.shield(lookup)

    async def _look_up(self, model: str) -> ModelWorkers:
        reading = ModelWorkers(tuple(await self.workers(model)))
        if reading.ready:
            self._reusable[model] = (time.monotonic() + LIVE_ANSWER_REUSE_S, reading)
        else:
            self._reusable.pop(model, None)  # a newer reading says no worker is ready
        return reading

    async def has_live_worker(self, model: str, fresh: bool = False) -> bool:
        """A ready worker serves ``model`` (``fresh``: as ``model_workers``)."""
        return bool((await self.model_workers(model, fresh)).ready)

    async def readable_version(self, model: str) -> int:
        """The job contract version to write for ``model`` (``ModelWorkers.readable_version``)."""
        return (await self.model_workers(model)).readable_version

    async def adapter_of(self, model: str) -> AdapterRecord | None:
        """The stored LoRA adapter named ``model``, where no worker serves a model of that name."""
        try:
            reading = await self.model_workers(model)
            if reading.workers:
                return None
            return await self.adapters.record(model)
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc

    async def require_worker(self, model: str) -> None:
        """404 for a model never served here, 503 for one with no ready or loading worker. A model
        whose workers are all loading passes: its job waits queued for one to be ready, for the
        no-worker grace at most (``api.jobs.orphans``), as every kind of request does. A LoRA
        adapter's name is its base model's question."""
        try:
            reading = await self.model_workers(model)
            if reading.ready or reading.loading:
                return
            adapter = await self.adapters.record(model)
            if adapter is not None:
                await self.require_worker(adapter.base)
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


def _holds(owner: WorkerInfo | None, record: JobRecord) -> bool:
    if owner is None or owner.instance != record.owner_instance:
        return False
    if "num_jobs" not in owner.model_fields_set:
        return True  # a release that does not count its jobs
    return owner.num_jobs > 0 or owner.heartbeat_at < record.updated_ms / 1000 + FORGOTTEN_AFTER_S
