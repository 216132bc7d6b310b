"""What becomes of a job that no worker is serving: one rule, :func:`decide`, for every API
process's housekeeper and for a stream watching its own job, so a job's fate does not depend on
which of them looks first. The decision is carried out through the lifecycle, whose transitions
are atomic and fenced by the job's epoch: of two processes acting on the same job, one succeeds.

=======  ===========  ===========  ==============  ==========  ===================  ====================
state    owner alive  live worker  loading worker  batch line  unserved past grace  decision
=======  ===========  ===========  ==============  ==========  ===================  ====================
running  yes          ·            ·               ·           ·                    wait
running  no           yes          ·               ·           ·                    reclaim
running  no           no           yes             ·           ·                    reclaim
running  no           no           no              yes         ·                    reclaim
running  no           no           no              no          ·                    fail: worker_lost
queued   ·            yes          ·               ·           ·                    wait
queued   ·            no           ·               yes         ·                    wait
queued   ·            no           ·               no          no                   wait
queued   ·            no           ·               no          yes, never ran       fail: no_live_worker
queued   ·            no           ·               no          yes, ran before      fail: worker_lost
=======  ===========  ===========  ==============  ==========  ===================  ====================

(· : either.) A live worker is a ready one: a loading worker claims no job, so a job whose model's
workers are all loading waits as one with no worker does, up to the grace, whatever kind of
request it is. A queued job is unserved since the later of its model's last ready-worker
heartbeat and its entering the queue: both are kept in Redis, so every API process measures the
same time and a restart does not reset it. "Reclaim" requeues the job at the front of its queue; the lifecycle
fails it with worker_lost instead once it has been started ``JOB_MAX_ATTEMPTS`` times. A batch
line never fails for want of a worker: its batch's completion window bounds it, and expiring the
batch stops it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import StrEnum

from api.jobs.worker_directory import WorkerDirectory
from shared.errors import ErrorKind
from shared.job_lifecycle import JobLifecycle, JobRecord, JobState
from shared.log_setup import log_transition

logger = logging.getLogger(__name__)


class OrphanAction(StrEnum):
    WAIT = "wait"  # served, or not unserved long enough: leave it as it is
    RECLAIM = "reclaim"  # back to its queue (failed past JOB_MAX_ATTEMPTS)
    FAIL_WORKER_LOST = "fail_worker_lost"
    FAIL_NO_LIVE_WORKER = "fail_no_live_worker"


@dataclass(frozen=True)
class OrphanFacts:
    """What the rule needs to know about one queued or running job."""

    state: JobState
    attempts: int  # times a worker started it
    is_owner_alive: bool  # for a running job: the process that claimed it still heartbeats
    has_live_worker: bool  # some ready worker of its model heartbeats
    has_loading_worker: bool  # some worker of its model heartbeats while it loads
    is_batch_line: bool
    unserved_for_s: float  # how long its model has had no worker (0 while it has one)


def decide(facts: OrphanFacts, no_worker_grace_s: float) -> OrphanAction:
    """The one orphan rule (the table in this module's docstring).

    A running job whose owner died fails at once when no worker serves its model or is loading it:
    its client has already seen part of the answer, and no one could continue it. Back in its
    queue, a job for a loading worker is a queued one. A queued one is given ``no_worker_grace_s``
    for a worker to come back or finish loading (a restart, a heartbeat late), then fails: waiting
    longer would leave a client, or a background job's poller, waiting forever."""
    if facts.state is JobState.RUNNING:
        if facts.is_owner_alive:
            return OrphanAction.WAIT
        if facts.has_live_worker or facts.has_loading_worker or facts.is_batch_line:
            return OrphanAction.RECLAIM
        return OrphanAction.FAIL_WORKER_LOST
    if facts.state is not JobState.QUEUED or facts.has_live_worker or facts.is_batch_line:
        return OrphanAction.WAIT
    if facts.unserved_for_s < no_worker_grace_s:
        return OrphanAction.WAIT
    # A job that ran and went back to its queue lost its worker, whoever requeued it: the client
    # hears that, not that the model was never served.
    return OrphanAction.FAIL_WORKER_LOST if facts.attempts else OrphanAction.FAIL_NO_LIVE_WORKER


class Orphans:
    """Gathers a job's facts, applies :func:`decide`, and carries the decision out."""

    def __init__(self, lifecycle: JobLifecycle, directory: WorkerDirectory, no_worker_grace_s: float) -> None:
        self._lifecycle = lifecycle
        self._directory = directory
        self._no_worker_grace_s = no_worker_grace_s

    async def settle(
        self, record: JobRecord, by: str, request_id: str | None = None, is_owner_alive: bool | None = None
    ) -> OrphanAction:
        """Decide and act for one queued or running job; ``is_owner_alive`` when already known
        (the housekeeper reads every owner at once)."""
        facts = await self.facts(record, is_owner_alive)
        action = decide(facts, self._no_worker_grace_s)
        if action is not OrphanAction.WAIT:
            await self._carry_out(record, action, by, request_id)
        return action

    async def facts(self, record: JobRecord, is_owner_alive: bool | None = None) -> OrphanFacts:
        directory = self._directory
        is_running = record.state is JobState.RUNNING
        if is_running and is_owner_alive is None:
            is_owner_alive = await directory.is_owner_alive(record)
        if is_running and is_owner_alive:
            # A live owner is itself a live worker of the job's model.
            has_live_worker, has_loading_worker = True, False
        else:
            reading = await directory.model_workers(record.model, fresh=True)
            has_live_worker, has_loading_worker = bool(reading.ready), bool(reading.loading)
        is_batch_line = record.queue == self._lifecycle.keys.batch_queue(record.model)
        unserved_for_s = 0.0
        if record.state is JobState.QUEUED and not has_live_worker and not is_batch_line:
            unserved_for_s = await self._unserved_for_s(record)
        return OrphanFacts(
            record.state, record.attempts, bool(is_owner_alive), has_live_worker, has_loading_worker, is_batch_line,
            unserved_for_s,
        )  # fmt: skip

    async def _unserved_for_s(self, record: JobRecord) -> float:
        """Since the later of the model's last ready-worker heartbeat (its record's ``last_seen``)
        and the job's entering its queue.
        Both are in Redis, so every API process, and one restarted, measures the same time."""
        last_seen = {model.model: model.last_seen for model in await self._directory.model_records()}
        since_s = max(last_seen.get(record.model, 0.0), record.updated_ms / 1000)
        return max(0.0, time.time() - since_s)

    async def _carry_out(self, record: JobRecord, action: OrphanAction, by: str, request_id: str | None) -> None:
        job_id, lifecycle = record.job_id, self._lifecycle
        if action is OrphanAction.RECLAIM:
            outcome = await lifecycle.reclaim(record)
            if outcome is not None:
                event = "requeued" if outcome is JobState.QUEUED else "failed"
                log_transition(
                    logger, event, job_id, request_id, dead_worker=record.owner, attempt=record.attempts, by=by
                )
            return
        kind, message = _failure(record, action)
        param = None if record.state is JobState.RUNNING else "model"
        if await lifecycle.end(job_id, JobState.FAILED, kind, message, record.epoch, param):
            log_transition(logger, "failed", job_id, request_id, code=kind.value, by=by)


def _failure(record: JobRecord, action: OrphanAction) -> tuple[ErrorKind, str]:
    job_id, model = record.job_id, record.model
    if action is OrphanAction.FAIL_NO_LIVE_WORKER:
        message = (
            f"No live worker served model `{model}` within the no-worker grace (its workers are gone or still "
            "loading); retry later."
        )
        return ErrorKind.NO_LIVE_WORKER, message
    if record.state is JobState.RUNNING:
        message = (
            f"worker {record.owner} stopped responding while serving job {job_id}, and no other "
            f"worker serves model `{model}`"
        )
    else:
        message = (
            f"the worker serving job {job_id} stopped before it finished, and no live worker serves "
            f"model `{model}` any more"
        )
    return ErrorKind.WORKER_LOST, message
