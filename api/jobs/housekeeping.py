"""The API process's job housekeeping, started by its lifespan: every ``batch_poll_interval_s`` it
settles the jobs no worker serves and keeps the results of background jobs that ended.

A live stream settles its own job at once (it is watching); the housekeeper covers the jobs
nobody watches: background jobs, batch lines, resumable streams whose client is away. Both apply
the same rule (:mod:`api.jobs.orphans`). Every API process runs one; all state is in Redis and
every transition is atomic and fenced by epoch, so two of them acting on the same job cannot both
succeed, and a restarted process carries on where the last one stopped.

Queued jobs whose model has had no worker for ``no_worker_grace_s`` are failed here too, not only
by a watching stream: otherwise a background job (or a resumable stream whose client left) would
stay queued forever, its poller told "queued" each time. The grace is measured from times kept in
Redis (the model's last heartbeat, the job's entry into its queue), so every API process agrees
and a restart does not start it again.

After Redis did not answer (an outage, a failover) no job is judged for one worker lease: the
workers could not heartbeat meanwhile, so a lapsed heartbeat says nothing about them yet
(:mod:`api.jobs.redis_outage`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from api.jobs.orphans import OrphanAction, Orphans
from api.jobs.redis_outage import RedisOutage
from api.jobs.results import ResultStore
from api.jobs.worker_directory import WorkerDirectory
from shared.job_lifecycle import JobLifecycle, JobState
from shared.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

_BY = "housekeeper"


class Housekeeper:
    def __init__(
        self,
        lifecycle: JobLifecycle,
        directory: WorkerDirectory,
        results: ResultStore,
        interval_s: float,
        no_worker_grace_s: float,
    ) -> None:
        self._lifecycle = lifecycle
        self._directory = directory
        self._results = results
        self._orphans = Orphans(lifecycle, directory, no_worker_grace_s)
        self._interval_s = interval_s
        self._no_worker_grace_s = no_worker_grace_s
        self._outage = RedisOutage(failover_wait_s=0.0)  # only its settling: the sweep always tries again
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever(), name="relaylm-housekeeping")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _run_forever(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self._interval_s)

    async def tick(self) -> None:
        """One sweep. A step that fails with a bug is logged and does not keep the others from
        running; with Redis away the rest would fail alike, so the sweep stops there. The next
        tick tries everything again."""
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("collecting background results", self._results.collect)
        ]
        if not self._outage.is_settling:
            steps[:0] = [("reaping orphans", self.reap_running), ("failing unserved queued jobs", self.fail_unserved)]
        for name, step in steps:
            try:
                await step()
            except RedisError as exc:
                self._outage.failed()
                logger.warning("housekeeping: %s: Redis unavailable (%s); retrying", name, exc)
                return
            except Exception:
                logger.exception("housekeeping: %s failed; retrying", name)
        self._outage.answered()

    async def reap_running(self) -> list[str]:
        """Settle the running jobs whose owner is gone (died, stopped heartbeating past its lease,
        or restarted under the same id); returns their ids."""
        lifecycle = self._lifecycle
        job_ids = await lifecycle.running_job_ids()
        if not job_ids:
            return []
        records = [r for r in (await lifecycle.records(job_ids)).values() if r and r.state is JobState.RUNNING]
        alive = await self._directory.live_owners(records)
        orphans = [record for record in records if not alive[record.job_id]]
        for record in orphans:
            await self._orphans.settle(record, _BY, is_owner_alive=False)
        return [record.job_id for record in orphans]

    async def fail_unserved(self) -> list[str]:
        """Settle the queued interactive and background jobs of models with no live worker for
        longer than the grace; returns the ids of those it failed."""
        failed: list[str] = []
        now = time.time()
        for model in await self._directory.model_records():
            # No job of a model heard from within the grace can be past it: skip the reads.
            if now - model.last_seen < self._no_worker_grace_s or await self._directory.has_live_worker(model.model):
                continue
            job_ids = await self._lifecycle.queued_job_ids(self._lifecycle.keys.queue(model.model))
            records = [r for r in (await self._lifecycle.records(job_ids)).values() if r and r.state is JobState.QUEUED]
            for record in records:
                if await self._orphans.settle(record, _BY) is not OrphanAction.WAIT:
                    failed.append(record.job_id)
        return failed
