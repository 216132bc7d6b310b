"""A worker's own check that every job Redis records as running under this process is one it runs.

API processes settle the jobs of workers that died (``api.jobs.housekeeping``); a live worker
that lost track of a job (a write a Redis failover lost, a claim handed out twice) would
otherwise keep it ``running`` until nobody waits for it any more. Every ``interval_s`` the worker
reads the running jobs of its queues; one recorded under its instance that it does not run, and
that nothing was written to for ``grace_s``, goes back to the front of its queue (fenced by its
epoch and this instance, so a job that moved on meanwhile is left alone) and is continued from
its log by the next claim.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from redis.exceptions import RedisError

from shared.job_lifecycle import JobLifecycle, JobState

logger = logging.getLogger(__name__)

AUDIT_INTERVAL_S = 5.0
# Longer than a claim takes to reach the job runner, shorter than a client's patience.
UNHELD_GRACE_S = 10.0


class JobAudit:
    def __init__(
        self,
        lifecycle: JobLifecycle,
        queues: list[str],
        instance: str,
        held: Callable[[], Collection[str]],
        interval_s: float = AUDIT_INTERVAL_S,
        grace_s: float = UNHELD_GRACE_S,
    ) -> None:
        """``held``: the ids of the jobs this worker runs now."""
        self._lifecycle = lifecycle
        self._queues = queues
        self._instance = instance
        self._held = held
        self._interval_s = interval_s
        self._grace_s = grace_s

    async def main(self) -> None:
        """Check every ``interval_s`` until cancelled; Redis failures wait for the next check."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except RedisError as exc:
                logger.debug("job audit skipped: %s", exc)

    async def check(self) -> list[str]:
        """Requeue the jobs recorded as running here that this worker does not run; their ids."""
        records = await self._lifecycle.running_records(self._queues)
        held = set(self._held())  # read after the records: a job claimed since is held by now
        quiet_since_ms = (time.time() - self._grace_s) * 1000
        requeued: list[str] = []
        for record in records:
            if record.job_id in held or record.state is not JobState.RUNNING:
                continue
            if record.owner_instance != self._instance or record.updated_ms > quiet_since_ms:
                continue
            if await self._lifecycle.requeue(record.job_id, record.epoch, self._instance):
                logger.warning(
                    "job %s: recorded as running on this worker, which does not run it; back to its queue",
                    record.job_id,
                )
                requeued.append(record.job_id)
        return requeued
