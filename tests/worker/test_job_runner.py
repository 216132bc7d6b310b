"""JobRunner against a real Redis: a job its worker cannot prepare still ends with an error event;
a job claimed again while it runs here (a failover) runs once and ends; a job cancelled before it
reached the engine never does.

The handlers and engines here are stand-ins (one fails on purpose, one records what it is given
and lets the test play the engine's last step); the Redis, publisher and event log are real.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from shared.contract import CONTRACT_VERSION, AnyJob, ChatJob, Generate, Message, encode_job
from shared.errors import ErrorKind, RelayError
from shared.events import AnyEvent, EndEvent, ErrorEvent, StartEvent, UsageCounts
from shared.job_lifecycle import Claim, JobLifecycle, JobState
from shared.redis import RedisTarget
from shared.redis_keys import RedisKeys
from worker.engine.engine import RequestOutput
from worker.kinds.base import JobInputs
from worker.service.job_runner import CONTRACT_GRACE_S, JobRunner, _Run
from worker.service.publisher import EventPublisher

MODEL = "runner-model"


class _FailingHandler:
    """Raises ``error`` from ``prepare``; it never reaches an engine."""

    engine = None

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def prepare(self, job: AnyJob, inputs: JobInputs) -> object:
        raise self.error


async def _claimed_chat_job(redis: Redis) -> tuple[RedisKeys, JobLifecycle, Claim]:
    """A chat job created on queue 'q' and claimed by worker-a."""
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    request = Generate(model=MODEL, messages=[Message(role="user", content="hi")])
    await lifecycle.create(job_id, encode_job(ChatJob(job_id=job_id, created=0, request=request)), MODEL, "q")
    claim = await lifecycle.claim("q", "worker-a", "instance-a")
    assert isinstance(claim, Claim)
    return keys, lifecycle, claim


async def _run_failing_job(redis: Redis, redis_url: str, error: Exception) -> ErrorEvent:
    keys, lifecycle, claim = await _claimed_chat_job(redis)
    job_id = claim.job_id
    publisher = EventPublisher(RedisTarget(redis_url), keys)
    runner = JobRunner(lifecycle, "worker-a", MODEL, _FailingHandler(error), publisher, 60.0)  # type: ignore[arg-type]
    try:
        await runner.run(claim)
    finally:
        publisher.close()
    events = await lifecycle.read_log(job_id)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    assert runner.active_job_ids == []
    record = await lifecycle.record(job_id)
    assert record is not None and record.state is JobState.FAILED
    return events[0]


async def test_an_unexpected_failure_while_preparing_ends_the_stream_with_an_internal_error(
    redis: Redis, redis_url: str
) -> None:
    event = await _run_failing_job(redis, redis_url, RuntimeError("tokenizer exploded"))
    assert event.kind is ErrorKind.INTERNAL and event.seq == 0
    assert "tokenizer exploded" not in event.message  # internals stay in the worker's log


async def test_a_refused_request_ends_the_stream_with_its_own_error(redis: Redis, redis_url: str) -> None:
    refusal = RelayError(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "too long", "messages")
    event = await _run_failing_job(redis, redis_url, refusal)
    assert (event.kind, event.message, event.param) == (ErrorKind.CONTEXT_LENGTH_EXCEEDED, "too long", "messages")


async def _run_claimed(lifecycle: JobLifecycle, redis_url: str, keys: RedisKeys, left: list[str]) -> None:
    claim = await lifecycle.claim("q", "worker-a", "instance-a")
    assert claim is not None
    publisher = EventPublisher(RedisTarget(redis_url), keys)
    runner = JobRunner(
        lifecycle, "worker-a", MODEL, _FailingHandler(RuntimeError("never prepared")), publisher, 60.0,  # type: ignore[arg-type]
        on_job_left=lambda: left.append("left"),
    )  # fmt: skip
    try:
        await runner.run(claim)
    finally:
        publisher.close()


async def test_a_job_in_a_newer_contract_is_left_for_a_worker_that_reads_it(redis: Redis, redis_url: str) -> None:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    payload = {"version": CONTRACT_VERSION + 1, "kind": "chat", "job_id": job_id, "created": time.time()}
    await lifecycle.create(job_id, json.dumps(payload).encode(), MODEL, "q")
    left: list[str] = []
    await _run_claimed(lifecycle, redis_url, keys, left)
    record = await lifecycle.record(job_id)
    assert record is not None and record.state is JobState.QUEUED  # back in its queue, not misread
    assert left == ["left"] and await lifecycle.read_log(job_id) == []
    assert await lifecycle.claim("q", "worker-b", "instance-b") is not None  # another worker may take it


async def test_a_newer_contract_job_nobody_reads_fails_after_the_grace(redis: Redis, redis_url: str) -> None:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = time.time() - CONTRACT_GRACE_S - 1
    payload = {"version": CONTRACT_VERSION + 1, "kind": "chat", "job_id": job_id, "created": created}
    await lifecycle.create(job_id, json.dumps(payload).encode(), MODEL, "q")
    left: list[str] = []
    await _run_claimed(lifecycle, redis_url, keys, left)
    events = await lifecycle.read_log(job_id)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent) and not left
    assert events[0].kind is ErrorKind.NO_LIVE_WORKER
    assert f"version {CONTRACT_VERSION + 1}" in events[0].message and "upgrade the workers" in events[0].message


class _Engine:
    """Records the jobs it is told to abort."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, job_id: str, *args: object) -> None:
        self.aborted.append(job_id)


class _Handler:
    def __init__(self) -> None:
        self.engine = _Engine()


async def _refused_writes(redis: Redis, redis_url: str, before: str) -> tuple[JobLifecycle, str, list[str]]:
    """A claimed job whose event writes were refused, after ``before`` happened to it on the
    primary: 'nothing' (another server refused them: a demoted primary during a failover),
    'cancelled' (its client left) or 'taken over' (another worker claimed it)."""
    keys, lifecycle, claim = await _claimed_chat_job(redis)
    job_id = claim.job_id
    if before == "cancelled":
        await lifecycle.cancel([job_id])
    elif before == "taken over":
        assert await lifecycle.requeue(job_id, claim.epoch)
        assert isinstance(await lifecycle.claim("q", "worker-b", "instance-b"), Claim)
    handler = _Handler()
    publisher = EventPublisher(RedisTarget(redis_url), keys)
    runner = JobRunner(lifecycle, "worker-a", MODEL, handler, publisher, 60.0)  # type: ignore[arg-type]
    run = _Run(claim, publisher.expect(job_id, claim.epoch), submitted=True)  # its request is in the engine
    runner._runs[job_id] = run
    try:
        await runner._settle_loss(run)
    finally:
        publisher.close()
    return lifecycle, job_id, handler.engine.aborted


async def test_writes_refused_by_a_former_primary_hand_the_job_back(redis: Redis, redis_url: str) -> None:
    lifecycle, job_id, aborted = await _refused_writes(redis, redis_url, "nothing")
    record = await lifecycle.record(job_id)
    assert record is not None and record.state is JobState.QUEUED and record.owner is None
    assert aborted == [job_id]
    again = await lifecycle.claim("q", "worker-b", "instance-b")  # the primary's next claim continues it
    assert isinstance(again, Claim) and again.job_id == job_id and again.attempt == 2


async def test_writes_refused_after_a_cancel_or_a_takeover_leave_the_job_alone(redis: Redis, redis_url: str) -> None:
    lifecycle, job_id, aborted = await _refused_writes(redis, redis_url, "cancelled")
    record = await lifecycle.record(job_id)
    assert record is not None and record.state is JobState.CANCELLED and aborted == []
    lifecycle, job_id, aborted = await _refused_writes(redis, redis_url, "taken over")
    record = await lifecycle.record(job_id)
    assert record is not None and record.state is JobState.RUNNING and record.owner == "worker-b"
    assert aborted == []


@dataclass
class _Work:
    """What a handler hands the engine: enough for the runner to submit and report it."""

    request_id: str
    start_event: StartEvent | None = None
    priority: int = 0
    num_prompt_tokens: int = 3
    num_completion_tokens: int = 0


class _RecordingEngine:
    """Records what it is given; the test plays the engine's part by writing through the sink."""

    def __init__(self) -> None:
        self.submitted: list[_Work] = []
        self.aborted: list[str] = []

    def submit(self, work: _Work) -> None:
        self.submitted.append(work)

    def abort(self, job_id: str, *args: object) -> None:
        self.aborted.append(job_id)


class _WorkHandler:
    """Prepares every job into a ``_Work``, once ``ready`` is set."""

    def __init__(self) -> None:
        self.engine = _RecordingEngine()
        self.ready = asyncio.Event()
        self.ready.set()

    async def prepare(self, job: AnyJob, inputs: JobInputs) -> _Work:
        await self.ready.wait()
        return _Work(job.job_id)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def _finish(publisher: EventPublisher, job_id: str, first_seq: int) -> None:
    """The engine's last step for the job: its start event (when first) and its end."""
    events: list[AnyEvent] = [StartEvent(seq=0, worker_id="worker-a", prompt_tokens=3)] if first_seq == 0 else []
    events.append(EndEvent(seq=max(first_seq, 1), usage=UsageCounts(prompt_tokens=3, completion_tokens=0)))
    publisher.sink([RequestOutput(job_id, events, True)])


def _runner(
    redis_url: str, keys: RedisKeys, lifecycle: JobLifecycle
) -> tuple[JobRunner[_Work], _WorkHandler, EventPublisher]:
    handler = _WorkHandler()
    publisher = EventPublisher(RedisTarget(redis_url), keys)
    return JobRunner(lifecycle, "worker-a", MODEL, handler, publisher, 60.0), handler, publisher  # type: ignore[arg-type]


async def test_a_job_claimed_again_under_its_epoch_goes_on_in_the_run_under_way(redis: Redis, redis_url: str) -> None:
    # A promoted replica that never saw the claim hands the same job to the same worker, under
    # the same epoch: one run, one engine request, and the job ends.
    keys, lifecycle, claim = await _claimed_chat_job(redis)
    runner, handler, publisher = _runner(redis_url, keys, lifecycle)
    try:
        first = asyncio.create_task(runner.run(claim))
        await _until(lambda: len(handler.engine.submitted) == 1)
        await asyncio.wait_for(runner.run(claim), 5)  # returns at once: nothing new to start
        assert len(handler.engine.submitted) == 1 and handler.engine.aborted == []
        _finish(publisher, claim.job_id, 0)
        await asyncio.wait_for(first, 5)
    finally:
        publisher.close()
    record = await lifecycle.record(claim.job_id)
    assert record is not None and record.state is JobState.FINISHED
    assert runner.active_job_ids == []


async def test_a_job_claimed_again_under_a_new_epoch_replaces_the_earlier_run(redis: Redis, redis_url: str) -> None:
    # The earlier run stops its engine request and goes, without forgetting, aborting or
    # handing back what the newer run now owns: the newer run's events end the job.
    keys, lifecycle, claim = await _claimed_chat_job(redis)
    runner, handler, publisher = _runner(redis_url, keys, lifecycle)
    try:
        first = asyncio.create_task(runner.run(claim))
        await _until(lambda: len(handler.engine.submitted) == 1)
        assert await lifecycle.requeue(claim.job_id, claim.epoch)
        again = await lifecycle.claim("q", "worker-a", "instance-a")
        assert isinstance(again, Claim) and again.epoch == claim.epoch + 1
        second = asyncio.create_task(runner.run(again))
        await asyncio.wait_for(first, 5)  # replaced: it ends without the job ending
        await _until(lambda: len(handler.engine.submitted) == 2)
        assert handler.engine.aborted == [claim.job_id]  # the earlier request, queued before the newer one
        assert runner.active_job_ids == [claim.job_id]
        _finish(publisher, claim.job_id, again.next_seq)
        await asyncio.wait_for(second, 5)
    finally:
        publisher.close()
    record = await lifecycle.record(claim.job_id)
    assert record is not None and record.state is JobState.FINISHED and record.epoch == again.epoch
    assert runner.active_job_ids == []


async def test_a_job_cancelled_while_it_is_prepared_never_reaches_the_engine(redis: Redis, redis_url: str) -> None:
    keys, lifecycle, claim = await _claimed_chat_job(redis)
    runner, handler, publisher = _runner(redis_url, keys, lifecycle)
    handler.ready.clear()
    try:
        run = asyncio.create_task(runner.run(claim))
        await _until(lambda: runner.active_job_ids == [claim.job_id])
        runner.cancel(claim.job_id)
        handler.ready.set()
        await asyncio.wait_for(run, 5)
    finally:
        publisher.close()
    # An abort sent now would find nothing to stop, and would not stop this job claimed again.
    assert handler.engine.submitted == [] and handler.engine.aborted == []
    assert runner.active_job_ids == []
