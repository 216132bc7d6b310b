"""Heartbeats into the worker registry: who serves which model, in what state, with what load."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.contract import CONTRACT_VERSION
from shared.redis_keys import MODEL_FORGET_AFTER_S, WORKER_HEARTBEAT_TTL_S, RedisKeys
from shared.registry import ModelRecord, WorkerInfo, WorkerLanes, WorkerState, WorkerTask
from shared.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

# Running and waiting sequences, prefix-cache hit rate, share of the KV budget held.
LoadProbe = Callable[[], tuple[int, int, float, float]]


class WorkerRegistration:
    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        worker_id: str,
        model: str,
        interval_s: float,
        task: WorkerTask,
        cpus: list[int] | None = None,
        sizes_own_threads: bool = False,
        lanes: WorkerLanes = "all",
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._interval_s = interval_s
        self.info = WorkerInfo(
            worker_id=worker_id,
            instance=uuid.uuid4().hex,
            model=model,
            task=task,
            state="loading",
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.time(),
            heartbeat_at=time.time(),
            cpus=cpus or [],
            sizes_own_threads=sizes_own_threads,
            contract_version=CONTRACT_VERSION,
            lanes=lanes,
        )
        self._load_probe: LoadProbe = lambda: (0, 0, 0.0, 0.0)
        self.jobs_probe: Callable[[], int] = lambda: 0  # jobs the queue consumers hold
        self.compile_probe: Callable[[], str] = lambda: "off"  # the compiled decode step's state
        self.vision_probe: Callable[[], tuple[int, int, float]] = lambda: (0, 0, 0.0)  # encoded, cache hits, seconds
        self.speculation_probe: Callable[[], tuple[int, int]] = lambda: (0, 0)  # drafted, accepted
        self._task: asyncio.Task[None] | None = None

    def set_ready(self, max_num_seqs: int, max_model_len: int, load_probe: LoadProbe) -> None:
        self.info.state = "ready"
        self.info.max_num_seqs = max_num_seqs
        self.info.max_model_len = max_model_len
        self._load_probe = load_probe

    async def set_state(self, state: WorkerState) -> None:
        self.info.state = state
        await self.beat()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="relaylm-heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        try:
            await self._redis.delete(self._keys.worker(self.info.worker_id))
            await self._redis.srem(self._keys.model_workers(self.info.model), self.info.worker_id)
        except RedisError:
            logger.warning("could not deregister worker %s", self.info.worker_id)

    async def beat(self) -> None:
        now = time.time()
        info = self.info
        info.heartbeat_at = now
        info.num_running, info.num_waiting, info.prefix_cache_hit_rate, info.kv_cache_usage = self._load_probe()
        info.num_jobs = self.jobs_probe()
        info.compiled_decode = self.compile_probe()
        info.images_encoded, info.image_cache_hits, info.vision_encode_seconds = self.vision_probe()
        info.spec_decode_num_draft_tokens, info.spec_decode_num_accepted_tokens = self.speculation_probe()
        is_ready = info.state == "ready"
        record = await self._model_record(now) if is_ready else self._first_record(now)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._keys.worker(info.worker_id), info.model_dump_json(), ex=WORKER_HEARTBEAT_TTL_S)
            pipe.sadd(self._keys.model_workers(info.model), info.worker_id)
            if is_ready:
                pipe.hset(self._keys.models(), info.model, record.model_dump_json())
            else:
                # Known, so a request waits for a ready worker instead of getting 404; but what the
                # record says (capabilities, when the model was last served) is a ready worker's.
                pipe.hsetnx(self._keys.models(), info.model, record.model_dump_json())
            await pipe.execute()

    def _first_record(self, now: float) -> ModelRecord:
        return ModelRecord(model=self.info.model, first_seen=now, last_seen=now, task=self.info.task)

    async def _model_record(self, now: float) -> ModelRecord:
        raw = await self._redis.hget(self._keys.models(), self.info.model)
        first_seen = now
        if raw:
            previous = ModelRecord.model_validate_json(raw)
            if now - previous.last_seen < MODEL_FORGET_AFTER_S:
                first_seen = previous.first_seen
        return ModelRecord(
            model=self.info.model,
            first_seen=first_seen,
            last_seen=now,
            max_model_len=self.info.max_model_len,
            task=self.info.task,
            vision=self.info.vision,
        )

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
            except RedisError as exc:
                logger.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self._interval_s)
