"""Batch lines, which no client streams: how each one stands, and its response once it has ended,
read from its event log with the same collectors a live request uses (a background job's ended
form is kept by :mod:`api.jobs.results` and rendered by its API).

A line whose worker died is settled by the :class:`~api.jobs.housekeeping.Housekeeper`,
like any job. Any API process may look at any job: everything read is in Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from api.render.chat import collect_completion
from api.render.completion import collect_text_completion
from api.render.embeddings import collect_embeddings
from api.render.events import EventReplay
from shared.contract import AnyJob, ChatJob, CompletionJob, EmbeddingJob, decode_job
from shared.errors import ErrorKind, RelayError
from shared.job_lifecycle import JobLifecycle, JobState


@dataclass(frozen=True)
class JobOutcome:
    """A finished job's HTTP status and body: the response object, or an OpenAI error body."""

    status_code: int
    body: dict[str, Any]

    @property
    def succeeded(self) -> bool:
        return self.status_code == 200


@dataclass(frozen=True)
class JobStatus:
    status: str  # "queued", "in_progress" or "finished"
    outcome: JobOutcome | None = None
    state: JobState | None = None  # the lifecycle's final state, once finished


def failure(error: RelayError) -> JobOutcome:
    return JobOutcome(error.status, error.to_body())


async def render_outcome(job: AnyJob, replay: EventReplay, reasoning_field: str) -> JobOutcome:
    """The response a non-stream request would have received."""
    response: BaseModel
    try:
        if isinstance(job, ChatJob):
            response = await collect_completion(replay, reasoning_field)
        elif isinstance(job, CompletionJob):
            response = await collect_text_completion(replay)
        elif isinstance(job, EmbeddingJob):
            response = await collect_embeddings(replay, job.delivery.encoding_format)
        else:  # a token count is never detached: only its own route submits one
            raise RelayError(ErrorKind.INVALID_REQUEST, f"job `{job.job_id}` has no response to collect")
    except RelayError as exc:
        return failure(exc)
    return JobOutcome(200, response.model_dump(mode="json", exclude_none=True))


class DetachedJobs:
    def __init__(self, lifecycle: JobLifecycle, reasoning_field: str) -> None:
        self._lifecycle = lifecycle
        self._reasoning_field = reasoning_field

    async def states(self, job_ids: list[str]) -> dict[str, JobStatus]:
        """Where each job stands; an ended one with its outcome."""
        if not job_ids:
            return {}
        statuses: dict[str, JobStatus] = {}
        for job_id, record in (await self._lifecycle.records(job_ids)).items():
            if record is None:
                gone = RelayError(ErrorKind.INTERNAL, f"job {job_id} is gone from Redis (expired, or Redis lost it)")
                statuses[job_id] = JobStatus("finished", failure(gone))
            elif record.state.is_final:
                statuses[job_id] = JobStatus("finished", await self._outcome(job_id), record.state)
            else:
                statuses[job_id] = JobStatus("in_progress" if record.state is JobState.RUNNING else "queued")
        return statuses

    async def _outcome(self, job_id: str) -> JobOutcome:
        stored = await self._lifecycle.stored(job_id)
        if stored is None:
            return failure(RelayError(ErrorKind.INTERNAL, f"job {job_id} has no stored request (expired)"))
        job = decode_job(stored.payload, stored.delivery)
        events = await self._lifecycle.read_log(job_id)
        return await render_outcome(job, EventReplay(job, events), self._reasoning_field)
