"""The orphan rule, branch by branch: a table of a job's circumstances and the decision they get."""

from __future__ import annotations

import pytest

from api.jobs.orphans import OrphanAction, OrphanFacts, decide
from shared.job_lifecycle import JobState

GRACE_S = 3.0
RUNNING, QUEUED = JobState.RUNNING, JobState.QUEUED


def _facts(
    state: JobState,
    attempts: int = 1,
    is_owner_alive: bool = False,
    has_live_worker: bool = False,
    has_loading_worker: bool = False,
    is_batch_line: bool = False,
    unserved_for_s: float = 0.0,
) -> OrphanFacts:
    return OrphanFacts(
        state, attempts, is_owner_alive, has_live_worker, has_loading_worker, is_batch_line, unserved_for_s
    )


CASES = {
    "running, owner alive": (_facts(RUNNING, is_owner_alive=True, has_live_worker=True), OrphanAction.WAIT),
    "running, owner dead, another worker lives": (_facts(RUNNING, has_live_worker=True), OrphanAction.RECLAIM),
    "running, owner dead, another worker loads": (_facts(RUNNING, has_loading_worker=True), OrphanAction.RECLAIM),
    "running, owner dead, no worker left": (_facts(RUNNING), OrphanAction.FAIL_WORKER_LOST),
    "running batch line, owner dead, no worker left": (_facts(RUNNING, is_batch_line=True), OrphanAction.RECLAIM),
    "queued, a worker lives": (_facts(QUEUED, attempts=0, has_live_worker=True), OrphanAction.WAIT),
    "queued, no worker, within the grace": (_facts(QUEUED, attempts=0, unserved_for_s=2.9), OrphanAction.WAIT),
    "queued, workers all loading, within the grace": (
        _facts(QUEUED, attempts=0, has_loading_worker=True, unserved_for_s=2.9),
        OrphanAction.WAIT,
    ),
    "queued, workers all loading past the grace": (
        _facts(QUEUED, attempts=0, has_loading_worker=True, unserved_for_s=GRACE_S),
        OrphanAction.FAIL_NO_LIVE_WORKER,
    ),
    "queued, no worker past the grace, never ran": (
        _facts(QUEUED, attempts=0, unserved_for_s=GRACE_S),
        OrphanAction.FAIL_NO_LIVE_WORKER,
    ),
    "queued, no worker past the grace, ran before": (
        _facts(QUEUED, attempts=2, unserved_for_s=60.0),
        OrphanAction.FAIL_WORKER_LOST,
    ),
    "queued batch line, no worker for long": (
        _facts(QUEUED, attempts=0, is_batch_line=True, unserved_for_s=3600.0),
        OrphanAction.WAIT,
    ),
    "ended": (_facts(JobState.FINISHED, unserved_for_s=3600.0), OrphanAction.WAIT),
}


@pytest.mark.parametrize(("facts", "expected"), list(CASES.values()), ids=list(CASES))
def test_the_orphan_rule(facts: OrphanFacts, expected: OrphanAction) -> None:
    assert decide(facts, GRACE_S) is expected


def test_no_grace_fails_a_queued_job_with_no_worker_at_once() -> None:
    assert decide(_facts(QUEUED, attempts=0), 0.0) is OrphanAction.FAIL_NO_LIVE_WORKER
