"""The job lifecycle against a real Redis: every transition, and every write a stale owner tries."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from shared.errors import ErrorKind
from shared.events import DeltaEvent, EndEvent, ErrorEvent, StartEvent, UsageCounts, encode_event
from shared.job_lifecycle import (
    AppendRequest,
    AppendStatus,
    Claim,
    EventAppender,
    JobLifecycle,
    JobQueueFull,
    JobState,
    NotYet,
    TenantJobsFull,
)
from shared.redis_keys import JOB_MAX_ATTEMPTS, RedisKeys


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[tuple[JobLifecycle, EventAppender, RedisKeys]]:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    client = Redis.from_url(redis_url)
    sync_client = sync_redis.Redis.from_url(redis_url)
    try:
        yield JobLifecycle(client, keys), EventAppender(sync_client, keys), keys
    finally:
        await client.aclose()
        sync_client.close()


def _encoded(*events: StartEvent | DeltaEvent | EndEvent) -> list[tuple[int, bytes]]:
    return [(event.seq, encode_event(event)) for event in events]


START = StartEvent(seq=0, worker_id="w", prompt_tokens=1)
END_2 = EndEvent(seq=2, usage=UsageCounts(prompt_tokens=1, completion_tokens=1))


async def _queued(lifecycle: JobLifecycle, keys: RedisKeys, job_id: str = "j1", limit: int = 0) -> str:
    await lifecycle.create(job_id, b'{"x": 1}', "m", keys.queue("m"), limit)
    return job_id


async def test_a_job_is_claimed_once_with_a_new_epoch_and_its_payload(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys = env
    await _queued(lifecycle, keys)
    claim = await lifecycle.claim(keys.queue("m"), "w1", "i1")
    assert claim is not None and (claim.job_id, claim.epoch, claim.attempt, claim.next_seq) == ("j1", 1, 1, 0)
    assert claim.payload == b'{"x": 1}'
    assert await lifecycle.claim(keys.queue("m"), "w2", "i2") is None
    record = await lifecycle.record("j1")
    assert (
        record is not None
        and record.state is JobState.RUNNING
        and (record.owner, record.owner_instance)
        == (
            "w1",
            "i1",
        )
    )
    assert await lifecycle.running_job_ids() == ["j1"]


async def test_a_tenant_limit_counts_its_open_jobs_until_they_end(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, appender, keys = env
    queue = keys.queue("m")
    await lifecycle.create("a1", b"{}", "m", queue, tenant="A", tenant_limit=2)
    await lifecycle.create("a2", b"{}", "m", queue, tenant="A", tenant_limit=2)
    with pytest.raises(TenantJobsFull):
        await lifecycle.create("a3", b"{}", "m", queue, tenant="A", tenant_limit=2)
    await lifecycle.create("b1", b"{}", "m", queue, tenant="B", tenant_limit=2)  # another tenant: its own count
    await lifecycle.create("x1", b"{}", "m", queue, tenant="A")  # not counted (a batch line)
    record = await lifecycle.record("a1")
    assert record is not None and record.tenant == "A"
    # One ends by its worker's last event, one by a cancel: both free a slot.
    claim = await lifecycle.claim(queue, "w", "i")
    assert claim is not None and claim.job_id == "a1"
    [reply] = appender.append([AppendRequest("a1", claim.epoch, _encoded(START), JobState.FINISHED)])
    assert reply.status is AppendStatus.WRITTEN
    await lifecycle.create("a3", b"{}", "m", queue, tenant="A", tenant_limit=2)
    await lifecycle.cancel(["a2"])
    await lifecycle.create("a4", b"{}", "m", queue, tenant="A", tenant_limit=2)
    with pytest.raises(TenantJobsFull):
        await lifecycle.create("a5", b"{}", "m", queue, tenant="A", tenant_limit=2)


async def test_the_queue_limit_counts_queued_and_running_jobs(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys = env
    await _queued(lifecycle, keys, "a", limit=2)
    await lifecycle.claim(keys.queue("m"), "w", "i")
    await _queued(lifecycle, keys, "b", limit=2)
    with pytest.raises(JobQueueFull):
        await _queued(lifecycle, keys, "c", limit=2)
    with pytest.raises(ValueError):
        await _queued(lifecycle, keys, "a")


async def test_appends_are_written_once_in_order_and_the_final_one_ends_the_job(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, appender, keys = env
    await _queued(lifecycle, keys)
    claim = await lifecycle.claim(keys.queue("m"), "w", "i")
    assert claim is not None
    delta = DeltaEvent(seq=1, content="a", finish_reason="stop")
    [reply] = appender.append([AppendRequest("j1", claim.epoch, _encoded(START, delta), None)])
    assert (reply.status, reply.next_seq) == (AppendStatus.WRITTEN, 2)
    # A retried write (its reply was lost) is not written twice.
    [reply] = appender.append([AppendRequest("j1", claim.epoch, _encoded(delta, END_2), JobState.FINISHED)])
    assert (reply.status, reply.next_seq) == (AppendStatus.WRITTEN, 3)
    assert [event.seq for event in await lifecycle.read_log("j1")] == [0, 1, 2]
    assert [event.seq for event in await lifecycle.read_log("j1", 2)] == [2]
    record = await lifecycle.record("j1")
    assert record is not None and record.state is JobState.FINISHED
    assert await lifecycle.running_job_ids() == []


async def test_a_claim_with_a_wait_takes_only_jobs_queued_that_long(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys = env
    await _queued(lifecycle, keys)
    not_yet = await lifecycle.claim(keys.queue("m"), "younger", "i2", min_wait_s=0.3)
    assert isinstance(not_yet, NotYet) and 0.2 < not_yet.ready_in_s <= 0.3
    record = await lifecycle.record("j1")
    assert record is not None and record.state is JobState.QUEUED
    await asyncio.sleep(not_yet.ready_in_s + 0.01)
    claim = await lifecycle.claim(keys.queue("m"), "younger", "i2", min_wait_s=0.3)
    assert isinstance(claim, Claim) and claim.job_id == "j1"
    assert await lifecycle.claim(keys.queue("m"), "younger", "i2", min_wait_s=0.3) is None  # empty queue


async def test_a_job_handed_back_is_old_enough_for_any_claimer(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys = env
    await _queued(lifecycle, keys)
    first = await lifecycle.claim(keys.queue("m"), "w1", "i1")
    assert isinstance(first, Claim)
    assert await lifecycle.requeue("j1", first.epoch)
    again = await lifecycle.claim(keys.queue("m"), "w2", "i2", min_wait_s=60)
    assert isinstance(again, Claim) and (again.job_id, again.epoch) == ("j1", 2)


async def test_a_gap_in_the_log_is_reported_with_where_to_resend_from(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, appender, keys = env
    await _queued(lifecycle, keys)
    claim = await lifecycle.claim(keys.queue("m"), "w", "i")
    assert claim is not None
    [reply] = appender.append([AppendRequest("j1", claim.epoch, _encoded(END_2), JobState.FINISHED)])
    assert (reply.status, reply.next_seq) == (AppendStatus.GAP, 0)
    record = await lifecycle.record("j1")
    assert record is not None and record.state is JobState.RUNNING


async def test_a_requeued_job_refuses_its_old_owner_and_goes_to_the_next_one(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, appender, keys = env
    await _queued(lifecycle, keys, "later")
    await _queued(lifecycle, keys)
    first = await lifecycle.claim(keys.queue("m"), "w1", "i1")
    assert first is not None and first.job_id == "later"
    old = await lifecycle.claim(keys.queue("m"), "w1", "i1")
    assert old is not None and old.job_id == "j1"
    appender.append([AppendRequest("j1", old.epoch, _encoded(START), None)])
    assert await lifecycle.requeue("j1", old.epoch)
    assert not await lifecycle.requeue("j1", old.epoch)  # a second API process finds nothing to do
    new = await lifecycle.claim(keys.queue("m"), "w2", "i2")
    assert new is not None and (new.job_id, new.epoch, new.attempt, new.next_seq) == ("j1", 2, 2, 1)
    [refused] = appender.append([AppendRequest("j1", old.epoch, _encoded(DeltaEvent(seq=1, content="x")), None)])
    assert refused.status is AppendStatus.REFUSED
    [written] = appender.append([AppendRequest("j1", new.epoch, _encoded(DeltaEvent(seq=1, content="y")), None)])
    assert written.status is AppendStatus.WRITTEN
    assert not await lifecycle.requeue("j1", old.epoch)


async def test_a_claim_a_failover_lost_fences_its_owner_out_when_another_makes_it_again(env) -> None:  # type: ignore[no-untyped-def]
    # The promoted replica never saw w1's claim: the job is queued there with the epoch it had
    # before, so w2's claim gets the same epoch number. Only w2's process may write or hand it back.
    lifecycle, appender, keys = env
    await _queued(lifecycle, keys)
    lost = await lifecycle.claim(keys.queue("m"), "w1", "i1")
    assert isinstance(lost, Claim) and lost.instance == "i1"
    assert await lifecycle.requeue("j1", lost.epoch, "i1")
    await lifecycle._redis.hset(keys.job("j1"), mapping={"epoch": lost.epoch - 1, "attempts": lost.attempt - 1})
    again = await lifecycle.claim(keys.queue("m"), "w2", "i2")
    assert isinstance(again, Claim) and (again.epoch, again.instance) == (lost.epoch, "i2")
    [refused] = appender.append([AppendRequest("j1", lost.epoch, _encoded(START), None, instance="i1")])
    assert refused.status is AppendStatus.REFUSED
    [written] = appender.append([AppendRequest("j1", again.epoch, _encoded(START), None, instance="i2")])
    assert written.status is AppendStatus.WRITTEN
    assert not await lifecycle.requeue("j1", lost.epoch, "i1")
    record = await lifecycle.record("j1")
    assert record is not None and record.state is JobState.RUNNING and record.owner_instance == "i2"
    assert await lifecycle.requeue("j1", again.epoch, "i2")


async def test_reclaim_fails_a_job_after_its_last_attempt_with_a_final_event(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys = env
    await _queued(lifecycle, keys)
    for attempt in range(1, JOB_MAX_ATTEMPTS + 1):
        claim = await lifecycle.claim(keys.queue("m"), "w", f"i{attempt}")
        assert claim is not None and claim.attempt == attempt
        record = await lifecycle.record("j1")
        assert record is not None
        expected = JobState.FAILED if attempt == JOB_MAX_ATTEMPTS else JobState.QUEUED
        assert await lifecycle.reclaim(record) is expected
    [event] = await lifecycle.read_log("j1")
    assert isinstance(event, ErrorEvent) and event.kind is ErrorKind.WORKER_LOST and event.seq == 0
    assert await lifecycle.running_job_ids() == []


async def test_cancel_ends_queued_and_running_jobs_once_and_refuses_their_worker(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, appender, keys = env
    await _queued(lifecycle, keys, "queued")
    await _queued(lifecycle, keys, "running")
    # Claims take the oldest first: "queued" was created first, so requeue it behind "running".
    first = await lifecycle.claim(keys.queue("m"), "w", "i")
    running = await lifecycle.claim(keys.queue("m"), "w", "i")
    assert first is not None and running is not None
    assert await lifecycle.requeue(first.job_id, first.epoch)
    await lifecycle.cancel(["queued", "running"])
    for job_id in ("queued", "running"):
        record = await lifecycle.record(job_id)
        assert record is not None and record.state is JobState.CANCELLED
        [event] = await lifecycle.read_log(job_id)
        assert isinstance(event, ErrorEvent) and event.kind is ErrorKind.CANCELLED
    assert not await lifecycle.end("running", JobState.FAILED, ErrorKind.INTERNAL, "again")
    [refused] = appender.append([AppendRequest("running", running.epoch, _encoded(START), None)])
    assert refused.status is AppendStatus.REFUSED
    assert await lifecycle.claim(keys.queue("m"), "w", "i") is None  # the cancelled one is gone from the queue


async def test_an_expiry_is_a_cancel_that_reports_expired_and_tells_the_workers(env, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys = env
    await _queued(lifecycle, keys, "line")
    assert await lifecycle.claim(keys.queue("m"), "w", "i") is not None
    client = Redis.from_url(redis_url)
    listener = client.pubsub()
    await listener.subscribe(keys.cancel_channel())
    try:
        await lifecycle.cancel(["line"], "the batch expired", JobState.EXPIRED)
        async with asyncio.timeout(5):
            while (message := await listener.get_message(ignore_subscribe_messages=True, timeout=1)) is None:
                pass
        assert message["data"] == b"line"
    finally:
        await listener.aclose()
        await client.aclose()
    record = await lifecycle.record("line")
    assert record is not None and record.state is JobState.EXPIRED
    [event] = await lifecycle.read_log("line")
    assert isinstance(event, ErrorEvent) and event.kind is ErrorKind.EXPIRED and event.message == "the batch expired"


async def test_a_background_result_is_kept_as_the_job_leaves_the_background_set(env, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys = env
    await lifecycle.track_background("b2")
    await lifecycle.track_background("b1")
    assert await lifecycle.background_job_ids() == ["b1", "b2"]
    await lifecycle.untrack_background("b1", '{"status": "completed"}', retention_s=60)
    assert await lifecycle.background_job_ids() == ["b2"]
    client = Redis.from_url(redis_url)
    try:
        assert await client.get(keys.ended_job("b1")) == b'{"status": "completed"}'
        assert 0 < await client.ttl(keys.ended_job("b1")) <= 60
    finally:
        await client.aclose()


async def test_a_queued_record_says_when_it_entered_its_queue(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys = env
    before_ms = int(time.time() * 1000)
    await _queued(lifecycle, keys, "j1")
    await _queued(lifecycle, keys, "j2")
    record = await lifecycle.record("j1")
    assert record is not None and before_ms <= record.updated_ms <= int(time.time() * 1000)
    assert await lifecycle.queued_job_ids(keys.queue("m")) == ["j1", "j2"]
