"""The workers that share this worker's cores: its torch threads, and which jobs it leaves to an older one.

Why threads: torch's OpenMP team spins on every core it is given. Two workers on a 2-core host,
each with 2 threads, decoded ~20x slower together than apart (3.4 vs 66 events/s): 4 spinning
threads on 2 cores. A worker runs cores // (1 + busy neighbours) threads, where a neighbour is
another live worker on the same host whose CPU set overlaps this one's and a busy one holds jobs.

Why pooling: on shared cores one worker batching every stream beats two workers batching half
each (a decode step reads the weights once for the whole batch; two workers read them twice).
So workers of one model on the same cores, each sizing its own threads, rank themselves by
start time: the oldest takes every job at once, the next takes only jobs that have waited
``SPILL_WAIT_S`` (the older one is full, busy elsewhere or dead), the third twice that, and so
on. The older worker then runs alone with every core until the younger one takes work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.redis_keys import RedisKeys
from shared.registry import WorkerInfo
from shared.tasks import cancel_and_wait
from worker.service.thread_budget import threads_for

logger = logging.getLogger(__name__)

# A busy neighbour beats at once (WorkerProcess), and this worker reads the registry this often:
# two workers overrun the cores for at most about this long when both turn busy together.
REFRESH_INTERVAL_S = 0.5
# How long a queued job waits for each older worker on the same cores before the next one takes it.
SPILL_WAIT_S = 0.25


@dataclass(frozen=True)
class PoolView:
    """What one read of the registry says about this worker's place on its host."""

    num_busy_neighbours: int
    rank: int  # 0: the oldest ready worker of its model on these cores (or it does not pool)


def view_of(me: WorkerInfo, records: list[WorkerInfo]) -> PoolView:
    """``records``: the live registry records (this worker's own among them or not)."""
    neighbours = [r for r in records if r.worker_id != me.worker_id and r.host == me.host and _overlap(me, r)]
    num_busy = sum(1 for r in neighbours if r.num_jobs > 0)
    if not me.sizes_own_threads:
        return PoolView(num_busy, rank=0)  # its thread count is fixed: it takes its share of jobs
    pool = [r for r in neighbours if r.model == me.model and r.state == "ready" and r.sizes_own_threads]
    rank = sum(1 for r in pool if (r.started_at, r.worker_id) < (me.started_at, me.worker_id))
    return PoolView(num_busy, rank)


def _overlap(a: WorkerInfo, b: WorkerInfo) -> bool:
    return not a.cpus or not b.cpus or not set(a.cpus).isdisjoint(b.cpus)


class HostPool:
    """Keeps a worker's torch threads at its share of its cores and its claim wait at its rank.

    ``apply`` is called (on the event loop) with each new thread count; the worker hands it to
    the engine thread, which alone may call torch.set_num_threads."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        me: WorkerInfo,
        num_cores: int,
        override: int | None,
        apply: Callable[[int], None],
        interval_s: float = REFRESH_INTERVAL_S,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._me = me  # the registration's record, kept current by the worker
        self.num_cores = num_cores
        self._override = override
        self._apply = apply
        self._interval_s = interval_s
        self.num_threads: int | None = None  # last count applied
        self.rank = 0
        self._task: asyncio.Task[None] | None = None

    def claim_min_wait_s(self) -> float:
        """How long a queued job must have waited before this worker takes it."""
        return self.rank * SPILL_WAIT_S

    async def refresh(self) -> PoolView:
        """Read the registry; apply the thread count if it changed."""
        view = view_of(self._me, await self.live_records())
        num_threads = threads_for(self.num_cores, 1 + view.num_busy_neighbours, self._override)
        if num_threads != self.num_threads:
            logger.info(
                "torch threads: %d (%d cores, %d busy neighbours on host %s)",
                num_threads, self.num_cores, view.num_busy_neighbours, self._me.host,
            )  # fmt: skip
            self._apply(num_threads)
            self.num_threads = num_threads
        if view.rank != self.rank:
            wait_s = view.rank * SPILL_WAIT_S
            logger.info("claims jobs queued for %.2f s or more (rank %d on its cores)", wait_s, view.rank)
            self.rank = view.rank
        return view

    async def live_records(self) -> list[WorkerInfo]:
        """Registry records (any model, host, task or state) whose heartbeat has not expired."""
        models = await self._redis.hkeys(self._keys.models())
        async with self._redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.smembers(self._keys.model_workers(_text(model)))
            members: list[set[bytes | str]] = await pipe.execute()
        worker_ids = sorted({_text(worker_id) for ids in members for worker_id in ids})
        if not worker_ids:
            return []
        raw = await self._redis.mget([self._keys.worker(worker_id) for worker_id in worker_ids])
        return [record for record in map(_parse, raw) if record is not None]

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="relaylm-host-pool")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except RedisError as exc:
                # Keep the current count and rank; a Redis outage must not stop the worker.
                logger.warning("could not read the workers on host %s: %r", self._me.host, exc)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse(raw: bytes | str | None) -> WorkerInfo | None:
    if raw is None:
        return None
    try:
        return WorkerInfo.model_validate_json(raw)
    except ValidationError:
        return None  # unreadable: not counted
