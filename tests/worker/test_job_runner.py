"""JobRunner against a real Redis: a job its worker cannot prepare still ends with an error event.

The handler here is a stand-in that fails on purpose (a real one fails this way only through a
bug); the Redis, publisher and event log are the real ones.
"""

from __future__ import annotations

import json
import time
import uuid

from redis.asyncio import Redis

from shared.contract import CONTRACT_VERSION, AnyJob, ChatJob, Generate, Message, encode_job
from shared.errors import ErrorKind, RelayError
from shared.events import ErrorEvent
from shared.job_lifecycle import Claim, JobLifecycle, JobState
from shared.redis import RedisTarget
from shared.redis_keys import RedisKeys
from worker.kinds.base import JobInputs
from worker.service.job_runner import CONTRACT_GRACE_S, JobRunner
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
    try:
        await runner._settle_loss(claim, None)
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
