"""One claimed job: prepare it, hand it to the engine, wait for its last event.

Every way out leaves the job in a final state or back in its queue: its final event written
(finished, failed, timed out), a refusal (the job moved on without us: stop generating), or,
when the worker stops before the job ends, handed back to the front of the queue so another
worker continues it from the tokens already sent.

A worker can be handed a job it already runs: during a Redis failover, a promoted replica that
never saw the claim gives the job out again. Under the same epoch it is the same claim seen
through the new primary, and the run already under way goes on (its publisher refills the log
the new primary lacks); under another epoch the new claim replaces the run of the older one, which stops
without touching the job, the engine or the publisher again.

A job written in a newer contract version than this worker reads (an upgrade under way) is
left in its queue for a worker that reads it, and the worker's consumers pause briefly so they
do not take it straight back; a job that no worker has taken for ``CONTRACT_GRACE_S`` fails
with an error that says what to upgrade.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

from redis.exceptions import RedisError

from shared.adapters import AdapterStore
from shared.contract import CONTRACT_VERSION, NewerContract, UnreadableJob, decode_job
from shared.errors import ErrorKind, RelayError
from shared.events import ErrorEvent, StartEvent
from shared.job_lifecycle import Claim, JobLifecycle, JobState
from shared.log_setup import log_transition
from worker.engine.engine import RequestOutput
from worker.kinds.base import Answer, JobHandler, JobInputs, W
from worker.service.publisher import EventPublisher, PublishOutcome

logger = logging.getLogger(__name__)

# After a timeout abort, how long the job's error event may take to be written.
_ABORT_GRACE_S = 10.0
_HAND_BACK_RETRY_S = 1.0
_HAND_BACK_TRIES = 10
# How long a job in a contract version this worker cannot read waits for a worker that can.
CONTRACT_GRACE_S = 60.0


@dataclass
class _Run:
    """One claim being worked on here; the runner's side effects on its job are this run's only
    while it is the job's current run."""

    claim: Claim
    done: asyncio.Future[PublishOutcome]
    request_id: str | None = None
    submitted: bool = False  # its work is in the engine
    cancelled: bool = False  # its client left before the work reached the engine


class JobRunner(Generic[W]):
    """Knows no worker kind: its handler turns each job into its engine's work."""

    def __init__(
        self,
        lifecycle: JobLifecycle,
        worker_id: str,
        model_id: str,
        handler: JobHandler[W],
        publisher: EventPublisher,
        job_timeout_s: float,
        on_job_left: Callable[[], None] | None = None,
        adapters: AdapterStore | None = None,
    ) -> None:
        """``on_job_left``: called after leaving a job this worker cannot read in its queue (the
        consumers pause, so that a worker that reads it takes it); ``adapters``: where jobs'
        LoRA adapters are stored."""
        self._lifecycle = lifecycle
        self._adapters = adapters
        self._worker_id = worker_id
        self._model_id = model_id
        self._handler = handler
        self._engine = handler.engine
        self._publisher = publisher
        self._job_timeout_s = job_timeout_s
        self._runs: dict[str, _Run] = {}
        self._on_job_left = on_job_left or (lambda: None)

    @property
    def active_job_ids(self) -> list[str]:
        return list(self._runs)

    def cancel(self, job_id: str) -> None:
        """The job was cancelled (its client went away): stop generating, send nothing more."""
        run = self._runs.get(job_id)
        if run is None:
            return
        log_transition(logger, "cancelled", job_id, run.request_id, by="client")
        run.cancelled = True
        if run.submitted:  # an abort names work already in the engine; earlier, the run never submits
            self._engine.abort(job_id)

    def _is_current(self, run: _Run) -> bool:
        return self._runs.get(run.claim.job_id) is run

    async def run(self, claim: Claim, priority: int = 0) -> None:
        """``priority``: 0 for the interactive queue's jobs, 1 for the batch queue's (a job's own
        priority, if higher, wins), -1 for a job in a slot kept for quiet API keys (it wins)."""
        job_id = claim.job_id
        earlier = self._runs.get(job_id)
        if earlier is not None and self._publisher.is_publishing(job_id, claim.epoch, claim.instance):
            logger.warning(
                "job %s: claimed again under epoch %d while it runs here (a promoted replica had not seen "
                "the claim); the run under way goes on", job_id, claim.epoch,
            )  # fmt: skip
            return
        if earlier is not None:
            logger.warning("job %s: claimed again under epoch %d; its older run here stops", job_id, claim.epoch)
            if earlier.submitted:
                self._engine.abort(job_id)  # queued before the new attempt, so it stops the earlier one
        run = _Run(claim, self._publisher.expect(job_id, claim.epoch, claim.instance))  # the older run's: replaced
        self._runs[job_id] = run
        try:
            await self._run(run, priority)
        except asyncio.CancelledError:
            if self._is_current(run):
                await asyncio.shield(self._hand_back(run))
            raise
        finally:
            if self._is_current(run):
                self._publisher.forget(job_id)
                del self._runs[job_id]

    async def _run(self, run: _Run, priority: int) -> None:
        claim = run.claim
        job_id = claim.job_id
        try:
            job = decode_job(claim.payload)
        except NewerContract as exc:
            await self._leave(claim, exc.version)
            return
        except UnreadableJob as exc:
            logger.error("job %s: refused a request payload that is not a job (%s)", job_id, exc)
            await self._end_with(claim, RelayError(ErrorKind.INVALID_REQUEST, "The job's request is unreadable."))
            return
        request_id = run.request_id = job.request_id
        log_transition(logger, "picked", job_id, request_id, worker=self._worker_id, attempt=claim.attempt)
        try:
            if job.request.model != self._model_id:
                raise RelayError(ErrorKind.MODEL_NOT_FOUND, f"this worker serves {self._model_id!r}", "model")
            prepared = await self._handler.prepare(job, JobInputs(self._lifecycle, claim, self._adapters))
        except Exception as exc:
            if self._is_current(run):
                await self._end_with(claim, self._refusal(exc, job_id, request_id))
            return
        if run.cancelled or not self._is_current(run):
            return  # its client left, or a newer claim of the job replaced this run, while it was prepared
        if isinstance(prepared, Answer):
            await self._answer(run, prepared)
            return
        work = prepared
        work.priority = priority if priority < 0 else max(priority, work.priority)
        if claim.next_seq == 0:
            work.start_event = StartEvent(seq=0, worker_id=self._worker_id, prompt_tokens=work.num_prompt_tokens)
        self._engine.submit(work)
        run.submitted = True
        log_transition(logger, "started", job_id, request_id, prompt_tokens=work.num_prompt_tokens)
        outcome = await self._wait(run)
        if outcome is PublishOutcome.REPLACED or not self._is_current(run):
            return  # the engine stops this attempt when the newer one arrives; nothing else is ours
        if outcome is PublishOutcome.LOST:
            self._engine.abort(job_id)
            await self._settle_loss(run)
            return
        log_transition(logger, "finished", job_id, request_id, completion_tokens=work.num_completion_tokens)

    async def _answer(self, run: _Run, answer: Answer) -> None:
        """A job answered without the engine: its start event, then the answer's events."""
        claim = run.claim
        start = StartEvent(seq=0, worker_id=self._worker_id, prompt_tokens=answer.num_prompt_tokens)
        await self._publisher.publish(RequestOutput(claim.job_id, [start, *answer.events], True))
        await self._wait(run)
        log_transition(logger, "answered", claim.job_id, run.request_id, tokens=answer.num_prompt_tokens)

    async def _leave(self, claim: Claim, version: int) -> None:
        """A job in a newer contract version: back to its queue for a worker that reads it, or,
        once it has waited ``CONTRACT_GRACE_S`` since it was created, failed."""
        created = _created_s(claim.payload)
        if created is not None and time.time() - created > CONTRACT_GRACE_S:
            message = (
                f"No worker took this job within {CONTRACT_GRACE_S:.0f} s: it is written in job contract version "
                f"{version}, and worker {self._worker_id} reads versions up to {CONTRACT_VERSION}; upgrade the "
                f"workers of model `{self._model_id}`."
            )
            log_transition(logger, "rejected", claim.job_id, None, code="contract_version", version=version)
            await self._end_with(claim, RelayError(ErrorKind.NO_LIVE_WORKER, message, "model"))
            return
        try:
            left = await self._lifecycle.requeue(claim.job_id, claim.epoch, claim.instance)
        except RedisError:
            left = False  # the job is reclaimed once this worker's lease on it lapses
        log_transition(logger, "left", claim.job_id, None, version=version, requeued=left)
        self._on_job_left()

    async def _wait(self, run: _Run) -> PublishOutcome:
        """The run's outcome; past the job timeout it is aborted with ``job_timeout``."""
        job_id = run.claim.job_id
        try:
            return await asyncio.wait_for(asyncio.shield(run.done), self._job_timeout_s)
        except TimeoutError:
            if not self._is_current(run):
                return PublishOutcome.REPLACED
            message = f"The job ran longer than the worker's job timeout ({self._job_timeout_s:.0f} s)."
            self._engine.abort(job_id, ErrorKind.JOB_TIMEOUT, message)
            log_transition(logger, "timed_out", job_id, run.request_id, timeout_s=self._job_timeout_s)
        try:
            return await asyncio.wait_for(run.done, _ABORT_GRACE_S)
        except TimeoutError:
            return PublishOutcome.LOST

    async def _settle_loss(self, run: _Run) -> None:
        """Why the job's writes were refused: cancelled (its client left), or taken over. A job
        whose record still runs under this worker's claim was refused by another server (a
        demoted primary, during a failover): it goes back to its queue, so that a claim on the
        primary continues it from its log; dropped, its stream would wait for a live worker
        that no longer runs it."""
        claim = run.claim
        job_id = claim.job_id
        try:
            record = await self._lifecycle.record(job_id)
        except RedisError:
            record = None
        if not self._is_current(run):
            return  # claimed again meanwhile: the job is the newer run's
        if record is not None and record.state is JobState.CANCELLED:
            log_transition(logger, "cancelled", job_id, run.request_id, by="client")
        elif (
            record is not None
            and record.state is JobState.RUNNING
            and record.epoch == claim.epoch
            and (not claim.instance or record.owner_instance == claim.instance)
        ):
            log_transition(logger, "refused", job_id, run.request_id, by="a former primary")
            await self._hand_back(run)
        else:
            state = record.state.value if record is not None else "gone"
            log_transition(
                logger, "dropped", job_id, run.request_id, reason="moved on without this worker", state=state
            )

    async def _hand_back(self, run: _Run) -> None:
        """The worker is stopping before the job ended: stop generating and requeue it, so another
        worker continues from the tokens already sent."""
        claim = run.claim
        if run.submitted:
            self._engine.abort(claim.job_id)
        if self._is_current(run):
            self._publisher.forget(claim.job_id)
        for _ in range(_HAND_BACK_TRIES):
            if not self._is_current(run):
                return  # claimed again while Redis was away: the newer run owns the job
            try:
                requeued = await self._lifecycle.requeue(claim.job_id, claim.epoch, claim.instance)
            except RedisError:
                await asyncio.sleep(_HAND_BACK_RETRY_S)
                continue
            reason = "requeued" if requeued else "already moved on"
            log_transition(logger, "handed_back", claim.job_id, run.request_id, outcome=reason)
            return
        logger.warning(
            "job %s: could not hand it back; API processes requeue it once this worker is gone", claim.job_id
        )

    async def _end_with(self, claim: Claim, error: RelayError) -> None:
        """End a job that never reached the engine with its error event."""
        event = ErrorEvent(seq=claim.next_seq, kind=error.kind, message=error.message, param=error.param)
        await self._publisher.publish(RequestOutput(claim.job_id, [event], True))

    def _refusal(self, exc: Exception, job_id: str, request_id: str | None) -> RelayError:
        """An unexpected exception (a bug, a tokenizer failure) must end the stream too: left
        unpublished, the client would wait on a job its live worker has already given up."""
        if not isinstance(exc, RelayError):
            logger.exception("job %s: preparing the request failed", job_id)
            exc = RelayError(ErrorKind.INTERNAL, "The worker failed to prepare this request.")
        log_transition(logger, "rejected", job_id, request_id, code=exc.spec.code or exc.kind.value)
        return exc


def _created_s(payload: bytes) -> float | None:
    """The Unix time a job was created, read from a payload of any version that names it."""
    try:
        created = json.loads(payload).get("created")
    except (ValueError, AttributeError):
        return None
    return float(created) if isinstance(created, int | float) and not isinstance(created, bool) else None
