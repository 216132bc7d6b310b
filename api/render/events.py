"""What a renderer reads: a job and its events in order, live (``api.jobs.stream.JobStream``)
or read back from an ended job's log (:class:`EventReplay`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from shared.contract import AnyJob
from shared.events import AnyEvent


class JobEvents(Protocol):
    job: AnyJob

    @property
    def job_id(self) -> str: ...

    def events(self) -> AsyncIterator[AnyEvent]: ...

    async def close(self) -> None: ...


class LiveJobEvents(JobEvents, Protocol):
    """A job being streamed, which knows its prompt's size once its worker started it, and which
    an API process that is stopping closes without cancelling the job (``keep_job``)."""

    prompt_tokens: int | None

    async def close(self, keep_job: bool = False) -> None: ...


class EventReplay:
    """A finished job's events read back from its log, for collecting a background job's or a
    batch line's response with the same code as a live non-stream request."""

    def __init__(self, job: AnyJob, events: list[AnyEvent]) -> None:
        self.job = job
        self._events = events

    @property
    def job_id(self) -> str:
        return self.job.job_id

    async def events(self) -> AsyncIterator[AnyEvent]:
        for event in self._events:
            yield event

    async def close(self) -> None:
        """Nothing to release: the job is over."""
