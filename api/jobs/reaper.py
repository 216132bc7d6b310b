"""Every running job has a live owner: jobs of workers that died, stopped heartbeating (paused
past their lease) or were restarted under the same id go back to their queue, or fail after
``JOB_MAX_ATTEMPTS``. Every API process runs one; the lifecycle's transitions are atomic and
fenced by epoch, so two of them acting on the same job cannot both succeed.

A live stream does this for its own job at once (it is watching); the reaper covers the jobs
nobody watches: background jobs, batch lines, resumable streams whose client is away.
"""

from __future__ import annotations

import logging

from api.jobs.worker_directory import WorkerDirectory
from shared.job_lifecycle import JobLifecycle, JobRecord, JobState
from shared.log_setup import log_transition

logger = logging.getLogger(__name__)


class JobReaper:
    def __init__(self, lifecycle: JobLifecycle, directory: WorkerDirectory) -> None:
        self._lifecycle = lifecycle
        self._directory = directory

    async def reap(self) -> list[str]:
        """Reclaim the running jobs whose owner is gone; returns their ids."""
        job_ids = await self._lifecycle.running_job_ids()
        if not job_ids:
            return []
        records = [r for r in (await self._lifecycle.records(job_ids)).values() if r and r.state is JobState.RUNNING]
        alive = await self._directory.live_owners(records)
        orphans = [record for record in records if not alive[record.job_id]]
        for record in orphans:
            await self._reclaim(record)
        return [record.job_id for record in orphans]

    async def _reclaim(self, record: JobRecord) -> None:
        outcome = await self._lifecycle.reclaim(record)
        if outcome is not None:
            log_transition(
                logger, "requeued" if outcome is JobState.QUEUED else "failed", record.job_id, None,
                dead_worker=record.owner, attempt=record.attempts, by="reaper",
            )  # fmt: skip
