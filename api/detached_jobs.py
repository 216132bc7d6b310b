"""Jobs no client streams (background jobs, batch lines): how each one stands, and its response
once it has ended, read from its event log with the same collectors a live request uses.

A detached job whose worker died is moved to another worker here, as a live stream's would be,
so that it finishes (or fails with ``worker_lost`` after ``JOB_MAX_ATTEMPTS``) without a client
watching. Any API process may look at any job: everything read and written is in Redis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from redis.asyncio import Redis

from api.chat_completion import collect_completion
from api.completion_render import collect_text_completion
from api.job_stream import EventReplay
from api.job_takeover import REQUEUED, JobTakeover
from api.routes.embeddings import collect_embeddings
from api.worker_directory import WorkerDirectory
from shared.errors import ErrorKind, RelayError
from shared.event_log import read_event_log
from shared.events import EndEvent, ErrorEvent, decode_event
from shared.jobs import AnyJob, ChatJob, CompletionJob, decode_job
from shared.log_setup import log_transition
from shared.redis_keys import JOB_CANCEL_TTL_S, RedisKeys

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobOutcome:
    """A finished job's HTTP status and body: the response object, or an OpenAI error body."""

    status_code: int
    body: dict[str, Any]

    @property
    def succeeded(self) -> bool:
        return self.status_code == 200


@dataclass(frozen=True)
class JobState:
    status: str  # "queued", "in_progress" or "finished"
    outcome: JobOutcome | None = None


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
        else:
            response = await collect_embeddings(replay, job.request.encoding_format)
    except RelayError as exc:
        return failure(exc)
    return JobOutcome(200, response.model_dump(mode="json", exclude_none=True))


class DetachedJobs:
    def __init__(
        self, redis: Redis, keys: RedisKeys, directory: WorkerDirectory, takeover: JobTakeover, reasoning_field: str
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._directory = directory
        self._takeover = takeover
        self._reasoning_field = reasoning_field

    async def states(self, job_ids: list[str], queue: str | None = None) -> dict[str, JobState]:
        """Where each job stands; a job whose worker died is requeued (to ``queue``, else its
        model's interactive queue) and reported as queued."""
        if not job_ids:
            return {}
        keys = self._keys
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.xrevrange(keys.job_event_log(job_id), count=1)
                pipe.get(keys.job_owner(job_id))
            replies = await pipe.execute()
        states: dict[str, JobState] = {}
        for i, job_id in enumerate(job_ids):
            last_entries, owner = replies[2 * i], replies[2 * i + 1]
            last = decode_event(last_entries[0][1][b"e"]) if last_entries else None
            if isinstance(last, EndEvent | ErrorEvent):
                states[job_id] = JobState("finished", await self._outcome(job_id))
            elif owner is None or owner.decode() == REQUEUED:
                states[job_id] = JobState("queued")
            elif await self._directory.is_worker_alive(owner.decode()):
                states[job_id] = JobState("in_progress")
            else:
                states[job_id] = await self._take_over(job_id, owner.decode(), queue)
        return states

    async def _outcome(self, job_id: str) -> JobOutcome:
        payload = await self._redis.get(self._keys.job_request(job_id))
        if payload is None:
            return failure(RelayError(ErrorKind.INTERNAL, f"job {job_id} has no stored request (expired)"))
        job = decode_job(payload)
        events = await read_event_log(self._redis, self._keys, job_id)
        return await render_outcome(job, EventReplay(job, events), self._reasoning_field)

    async def _take_over(self, job_id: str, dead_worker_id: str, queue: str | None) -> JobState:
        payload = await self._redis.get(self._keys.job_request(job_id))
        if payload is None:
            return JobState("finished", failure(RelayError(ErrorKind.WORKER_LOST, "the job's worker died")))
        job = decode_job(payload)
        attempts = int(await self._redis.get(self._keys.job_attempts(job_id)) or 0)
        outcome = await self._takeover.requeue(job_id, job.request.model, dead_worker_id, attempts, queue)
        if outcome == -1:
            message = f"the job's worker died {attempts} times; giving up"
            log_transition(logger, "failed", job_id, job.request_id, reason="out of attempts")
            return JobState("finished", failure(RelayError(ErrorKind.WORKER_LOST, message)))
        if outcome == 1:
            log_transition(logger, "requeued", job_id, job.request_id, dead_worker=dead_worker_id)
        return JobState("queued")

    async def cancel(self, job_ids: list[str]) -> None:
        """Tell workers to stop these jobs and queued ones never to start."""
        if not job_ids:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.set(self._keys.job_cancelled(job_id), b"1", ex=JOB_CANCEL_TTL_S)
                pipe.publish(self._keys.cancel_channel(), job_id.encode())
            await pipe.execute()
