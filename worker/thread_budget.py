"""How many torch threads a worker runs: its share of the host's cores, re-checked as workers come and go.

Why: torch's OpenMP team spins on every core it is given. Two workers on a 2-core host, each with
2 threads, decoded ~20x slower together than apart (3.4 vs 66 events/s): 4 spinning threads on
2 cores. Each worker takes cores // (live workers on the host) threads, unless --num-threads says.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.redis_keys import RedisKeys
from shared.registry import WorkerInfo

logger = logging.getLogger(__name__)

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
# Registry records expire 5 s after a worker's last heartbeat; checking more often than that
# finds a new or dead worker within a few seconds for 3 small round trips.
REFRESH_INTERVAL_S = 2.0


def available_cores(cpu_max_path: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may use: its CPU affinity (taskset), capped by a cgroup v2 CPU quota."""
    get_affinity = getattr(os, "sched_getaffinity", None)
    num_cores = len(get_affinity(0)) if get_affinity is not None else (os.cpu_count() or 1)
    quota_cores = _cgroup_quota_cores(cpu_max_path)
    return min(num_cores, quota_cores) if quota_cores is not None else num_cores


def _cgroup_quota_cores(cpu_max_path: Path) -> int | None:
    """``cpu.max`` holds "<quota_us> <period_us>", or "max <period_us>" when there is no quota."""
    try:
        quota_us, period_us = cpu_max_path.read_text().split()
        return max(1, math.ceil(int(quota_us) / int(period_us)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def threads_for(num_cores: int, num_workers_on_host: int, override: int | None) -> int:
    """Torch threads for one worker: the override when given, else an equal share of the cores."""
    if override is not None and override > 0:
        return override
    return max(1, num_cores // max(1, num_workers_on_host))


class ThreadBudget:
    """Keeps a worker's torch thread count at its share of the host's cores.

    ``apply`` is called (on the event loop) with each new count; the worker hands it to the
    engine thread, which alone may call torch.set_num_threads."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        host: str,
        override: int | None,
        apply: Callable[[int], None],
        num_cores: int | None = None,
        interval_s: float = REFRESH_INTERVAL_S,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._host = host
        self._override = override
        self._apply = apply
        self.num_cores = num_cores if num_cores is not None else available_cores()
        self._interval_s = interval_s
        self.num_threads: int | None = None  # last count applied
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> int:
        """Count the live workers on this host; apply the thread count if it changed."""
        num_workers = await self.count_workers_on_host()
        num_threads = threads_for(self.num_cores, num_workers, self._override)
        if num_threads != self.num_threads:
            logger.info(
                "torch threads: %d (%d cores, %d workers on host %s)",
                num_threads, self.num_cores, num_workers, self._host,
            )  # fmt: skip
            self._apply(num_threads)
            self.num_threads = num_threads
        return num_threads

    async def count_workers_on_host(self) -> int:
        """Registry records (any model, task or state) on this host whose heartbeat has not expired."""
        models = await self._redis.hkeys(self._keys.models())
        async with self._redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.smembers(self._keys.model_workers(_text(model)))
            members: list[set[bytes | str]] = await pipe.execute()
        worker_ids = sorted({_text(worker_id) for ids in members for worker_id in ids})
        if not worker_ids:
            return 0
        records = await self._redis.mget([self._keys.worker(worker_id) for worker_id in worker_ids])
        return sum(1 for record in records if record is not None and _host_of(record) == self._host)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="relaylm-thread-budget")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except RedisError as exc:
                # Keep the current count; a Redis outage must not stop the worker.
                logger.warning("could not count the workers on host %s: %r", self._host, exc)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _host_of(record: bytes | str) -> str | None:
    try:
        return WorkerInfo.model_validate_json(record).host
    except ValidationError:
        return None  # unreadable: not counted
