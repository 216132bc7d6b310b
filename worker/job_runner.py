"""The arq job: load the request, prepare it, hand it to the engine, wait for its last event."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.asyncio import Redis

from shared.errors import ErrorKind, RelayError
from shared.event_log import read_event_log
from shared.events import DeltaEvent, EndEvent, ErrorEvent, StartEvent
from shared.jobs import AnyJob, decode_job
from shared.log_setup import log_transition
from shared.redis_keys import JOB_REQUEST_TTL_S, RedisKeys
from worker.engine.engine import RequestOutput
from worker.engine.sequence import ResumeState
from worker.job_handlers import JobHandler, Work
from worker.publisher import EventPublisher

logger = logging.getLogger(__name__)

# KEYS: request, cancelled flag, attempts, owner, arq id; ARGV: worker id, arq job id, TTL (s).
# Returns {} when the request is gone, {request, 0} when the job was cancelled before it started,
# else {request, attempt} with this worker recorded as the job's owner.
_LOAD_AND_CLAIM = """
local request = redis.call('GET', KEYS[1])
if not request then return {} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {request, 0} end
local attempt = redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
redis.call('SET', KEYS[4], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[5], ARGV[2], 'EX', ARGV[3])
return {request, attempt}
"""

# A resume state meaning "nothing left to do": the job's log already holds its last event.
_ALREADY_FINISHED = ResumeState(next_event_seq=0, output_token_ids={}, finished_choices=frozenset())


class JobRunner:
    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        worker_id: str,
        model_id: str,
        handler: JobHandler,
        publisher: EventPublisher,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._worker_id = worker_id
        self._model_id = model_id
        self._handler = handler
        self._engine = handler.engine
        self._publisher = publisher
        self.active_job_ids: set[str] = set()
        self._request_ids: dict[str, str | None] = {}
        self._load_and_claim_script = redis.register_script(_LOAD_AND_CLAIM)

    async def run(self, job_id: str, arq_job_id: str, priority: int = 0) -> dict[str, Any]:
        """``priority``: 0 for the interactive queue's jobs, 1 for batch lines."""
        self.active_job_ids.add(job_id)
        try:
            return await self._run(job_id, arq_job_id, priority)
        finally:
            self.active_job_ids.discard(job_id)
            self._request_ids.pop(job_id, None)

    def cancel(self, job_id: str) -> None:
        """The client went away: stop generating, send nothing more."""
        if job_id in self.active_job_ids:
            log_transition(logger, "cancelled", job_id, self._request_ids.get(job_id), by="client")
            self._engine.abort(job_id)

    async def _run(self, job_id: str, arq_job_id: str, priority: int) -> dict[str, Any]:
        payload, attempt = await self._load_and_claim(job_id, arq_job_id)
        if payload is None:
            logger.warning("job %s has no request payload (expired?); dropped", job_id)
            return {"status": "missing"}
        try:
            job = decode_job(payload)
        except ValueError:
            logger.error("job %s: refused a request payload that is not a JSON job", job_id)
            return {"status": "refused"}
        request_id = self._request_ids[job_id] = job.request_id
        if attempt == 0:
            log_transition(logger, "dropped", job_id, request_id, reason="cancelled before start")
            return {"status": "cancelled"}
        resume = await self._resume_state(job_id) if attempt > 1 else None
        log_transition(logger, "picked", job_id, request_id, worker=self._worker_id, attempt=attempt)
        if resume is _ALREADY_FINISHED:
            log_transition(logger, "dropped", job_id, request_id, reason="finished before its worker died")
            return {"status": "finished"}
        done = self._publisher.expect(job_id)
        try:
            work = self._prepare(job, resume)
        except Exception as exc:
            error = self._refusal(exc, job_id, request_id, resume)
            await self._publisher.publish(RequestOutput(job_id, [error], True))
            await done
            return {"status": "rejected", "kind": error.kind.value}
        work.priority = priority
        if resume is None:
            work.start_event = StartEvent(seq=0, worker_id=self._worker_id, prompt_tokens=work.num_prompt_tokens)
        self._engine.submit(work)  # type: ignore[arg-type]
        log_transition(logger, "started", job_id, request_id, prompt_tokens=work.num_prompt_tokens)
        try:
            await done
        except asyncio.CancelledError:
            self._engine.abort(job_id, ErrorKind.WORKER_SHUTTING_DOWN, "the worker stopped during generation")
            log_transition(logger, "aborted", job_id, request_id, reason="worker stopping")
            raise
        log_transition(
            logger, "finished", job_id, request_id, completion_tokens=getattr(work, "num_completion_tokens", 0)
        )
        return {"status": "done"}

    def _refusal(self, exc: Exception, job_id: str, request_id: str | None, resume: ResumeState | None) -> ErrorEvent:
        """The error event that ends a job its worker could not prepare. An unexpected exception
        (a bug, a tokenizer failure) must end the stream too: left unpublished, the client would
        wait on a job its live worker has already given up."""
        if not isinstance(exc, RelayError):
            logger.exception("job %s: preparing the request failed", job_id)
            exc = RelayError(ErrorKind.INTERNAL, "The worker failed to prepare this request.")
        log_transition(logger, "rejected", job_id, request_id, code=exc.spec.code or exc.kind.value)
        seq = resume.next_event_seq if resume is not None else 0
        return ErrorEvent(seq=seq, kind=exc.kind, message=exc.message, param=exc.param)

    def _prepare(self, job: AnyJob, resume: ResumeState | None) -> Work:
        if job.request.model != self._model_id:
            raise RelayError(ErrorKind.MODEL_NOT_FOUND, f"this worker serves {self._model_id!r}", "model")
        return self._handler.prepare(job, resume)

    async def _load_and_claim(self, job_id: str, arq_job_id: str) -> tuple[bytes | None, int]:
        """The job's request and this attempt's number (0: cancelled before it started, so not
        claimed), in one round trip on the time-to-first-token path. Claiming records this worker
        as the job's owner: the API watches the owner's heartbeat."""
        keys = self._keys
        reply = await self._load_and_claim_script(
            keys=[
                keys.job_request(job_id), keys.job_cancelled(job_id), keys.job_attempts(job_id),
                keys.job_owner(job_id), keys.job_arq_id(job_id),
            ],
            args=[self._worker_id, arq_job_id, JOB_REQUEST_TTL_S],
        )  # fmt: skip
        if not reply:
            return None, 0
        payload, attempt = reply
        return payload, int(attempt)

    async def _resume_state(self, job_id: str) -> ResumeState | None:
        """What the job's earlier attempts sent, from its event log."""
        events = await read_event_log(self._redis, self._keys, job_id)
        if any(isinstance(event, EndEvent | ErrorEvent) for event in events):
            return _ALREADY_FINISHED
        sent: dict[int, list[int]] = {}
        finished: set[int] = set()
        for event in events:
            if isinstance(event, DeltaEvent):
                sent.setdefault(event.index, []).extend(event.token_ids)
                if event.finish_reason is not None:
                    finished.add(event.index)
        next_seq = max((event.seq for event in events), default=0) + 1
        return ResumeState(next_seq, sent, frozenset(finished))
