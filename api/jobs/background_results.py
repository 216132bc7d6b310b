"""A background job's result, kept once the job ends: the housekeeper collects every ended one,
and a poll or a cancel stores its own at once rather than wait for the next sweep. Storing the
result and dropping the job from the background set is one lifecycle call, so a result is kept
exactly when the job stops being collected."""

from __future__ import annotations

import json
from typing import Any

from api.jobs.detached import DetachedJobs, JobOutcome
from shared.contract import AnyJob, decode_job
from shared.job_lifecycle import JobLifecycle


class BackgroundResults:
    def __init__(self, lifecycle: JobLifecycle, jobs: DetachedJobs, retention_s: int) -> None:
        self._lifecycle = lifecycle
        self._jobs = jobs
        self._retention_s = retention_s

    async def collect(self) -> list[str]:
        """Keep the result of every background job that ended; returns their ids."""
        lifecycle = self._lifecycle
        states = await self._jobs.states(await lifecycle.background_job_ids())
        collected: list[str] = []
        for job_id, state in states.items():
            if state.outcome is None:
                continue
            status = "completed" if state.outcome.succeeded else "failed"
            payload = await lifecycle.payload(job_id)
            job = decode_job(payload) if payload is not None else None
            tenant = job.tenant if job is not None else None
            await self.store(job_id, status, state.outcome, _summary(job_id, job, status), tenant)
            collected.append(job_id)
        return collected

    async def store(
        self, job_id: str, status: str, outcome: JobOutcome | None, summary: dict[str, Any], tenant: str | None
    ) -> None:
        """Keep a background job's result (or its failure or cancellation) for the retention
        period, with the owner id of the key that submitted it."""
        record: dict[str, Any] = {"status": status, "summary": summary, "tenant": tenant}
        record["body"] = outcome.body if outcome else None
        await self._lifecycle.untrack_background(job_id, json.dumps(record), self._retention_s)


def _summary(job_id: str, job: AnyJob | None, status: str) -> dict[str, Any]:
    if job is None:
        return {"id": job_id, "object": "chat.completion", "status": status, "choices": []}
    return {"id": job_id, "object": "chat.completion", "created": job.created, "model": job.model}
