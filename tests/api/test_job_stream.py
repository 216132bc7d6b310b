"""Event ordering in the API's job stream against a real Redis: duplicates dropped, gaps filled
from the job's event log, and reported when the log does not have them either; a silent stream
reads what pub/sub dropped from the log; bytes that are not an event end the stream. After the
event subscription was renewed the stream reads the log from its cursor on; under Sentinel or
Cluster it rides out Redis not answering, and ends with an error when the job itself is lost."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Iterator

import pytest
import redis as sync_redis

from api.jobs.event_router import RENEWED, ChannelItem, EventRouter, SubscriptionRenewed
from api.jobs.stream import JobStream, StreamServices
from api.jobs.worker_directory import WorkerDirectory
from api.metrics import Metrics
from api.request_metrics import RequestObserver
from api.settings import ApiSettings
from relaylm.redis_launcher import RedisHandle, find_redis_server, start_redis
from shared.contract import ChatJob, Generate, Message
from shared.errors import ErrorKind, RelayError
from shared.events import AnyEvent, DeltaEvent, EndEvent, ErrorEvent, StartEvent, UsageCounts, encode_event
from shared.job_lifecycle import AppendRequest, EventAppender, JobLifecycle, JobState
from shared.redis import RedisTarget, connect_redis
from shared.redis_keys import RedisKeys

JOB_ID = "chatcmpl-test"
# Under Sentinel a stream rides out Redis not answering; only whether Redis is replicated matters
# to it, so no sentinel needs to listen there.
UNDER_SENTINEL = {"redis_sentinels": "127.0.0.1:1", "redis_failover_wait_s": 30.0}


async def _stream(
    redis_url: str,
    live: list[AnyEvent | ChannelItem],
    logged: list[AnyEvent],
    backlog: list[AnyEvent] | None = None,
    next_seq: int = 0,
    liveness_check_interval_s: float = 30.0,
    no_worker_grace_s: float = 30.0,
    requeued: bool = False,
    keys: RedisKeys | None = None,
    **settings: object,
) -> JobStream:
    """A running job whose worker wrote ``logged`` and whose channel brought ``live``; with
    ``requeued``, then put back in its queue as the housekeeper does when that worker dies."""
    redis = connect_redis(RedisTarget(redis_url))  # every command bounded by its timeout
    keys = keys or RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    await lifecycle.create(JOB_ID, b"{}", "m", keys.queue("m"))
    claim = await lifecycle.claim(keys.queue("m"), "w", "i")
    assert claim is not None
    if logged:
        _append(redis_url, keys, logged)
    if requeued:
        assert await lifecycle.requeue(JOB_ID, claim.epoch)
    queue: asyncio.Queue[ChannelItem] = asyncio.Queue()
    for item in live:
        queue.put_nowait(item if isinstance(item, bytes | SubscriptionRenewed) else encode_event(item))
    request = Generate(model="m", messages=[Message(role="user", content="x")])
    job = ChatJob(job_id=JOB_ID, created=1, request=request)
    observer = RequestObserver(Metrics(), "m", arrived_at=0.0)
    api_settings = ApiSettings(
        liveness_check_interval_s=liveness_check_interval_s,
        no_worker_grace_s=no_worker_grace_s,
        **settings,  # type: ignore[arg-type]
    )
    services = StreamServices(lifecycle, EventRouter(redis, keys), WorkerDirectory(redis, keys), api_settings)
    return JobStream(services, job, queue, None, observer, backlog, next_seq)


def _append(redis_url: str, keys: RedisKeys, events: list[AnyEvent]) -> None:
    """What the job's worker writes: the events into the log (and its channel), in one step."""
    client = sync_redis.Redis.from_url(redis_url)
    try:
        epoch = int(client.hget(keys.job(JOB_ID), "epoch") or 0)
        final = JobState.FINISHED if isinstance(events[-1], EndEvent) else None
        request = AppendRequest(JOB_ID, epoch, [(e.seq, encode_event(e)) for e in events], final)
        [reply] = EventAppender(client, keys).append([request])
        assert reply.status.value == "written", reply
    finally:
        client.close()


START = StartEvent(seq=0, worker_id="w", prompt_tokens=1)
DELTA_1, DELTA_2 = DeltaEvent(seq=1, content="a"), DeltaEvent(seq=2, content="b")
END = EndEvent(seq=3, usage=UsageCounts(prompt_tokens=1, completion_tokens=2))


async def test_duplicates_are_dropped_and_the_stream_ends_at_end(redis_url: str) -> None:
    stream = await _stream(redis_url, [START, DELTA_1, DELTA_1, DELTA_2, END], [])
    assert [event async for event in stream.events()] == [START, DELTA_1, DELTA_2, END]
    assert stream.is_finished


async def test_a_gap_is_filled_from_the_event_log(redis_url: str) -> None:
    stream = await _stream(redis_url, [START, DELTA_2, END], [START, DELTA_1, DELTA_2])
    assert [event async for event in stream.events()] == [START, DELTA_1, DELTA_2, END]


async def test_a_gap_the_log_cannot_fill_is_reported(redis_url: str) -> None:
    stream = await _stream(redis_url, [START, DELTA_2], [START])
    await stream.next_event()
    with pytest.raises(RelayError) as raised:
        await stream.next_event()
    assert raised.value.kind is ErrorKind.STREAM_GAP


async def test_a_reconnect_starts_after_the_last_event_the_client_saw(redis_url: str) -> None:
    stream = await _stream(redis_url, [], [], backlog=[START, DELTA_1, DELTA_2, END], next_seq=2)
    assert [event async for event in stream.events()] == [DELTA_2, END]


async def test_a_lost_last_event_is_read_from_the_log_once_the_stream_falls_silent(redis_url: str) -> None:
    stream = await _stream(redis_url, [START, DELTA_1, DELTA_2], [START, DELTA_1, DELTA_2, END], None, 0, 0.2)
    async with asyncio.timeout(5):
        assert [event async for event in stream.events()] == [START, DELTA_1, DELTA_2, END]


async def test_bytes_that_are_not_an_event_end_the_stream_with_an_error(redis_url: str) -> None:
    stream = await _stream(redis_url, [START, b"\x80\x04junk", DELTA_1], [])
    assert await stream.next_event() == START
    with pytest.raises(RelayError) as raised:
        await stream.next_event()
    assert raised.value.kind is ErrorKind.EVENT_UNREADABLE


async def test_a_job_requeued_from_its_dead_worker_with_none_left_ends_as_worker_lost(redis_url: str) -> None:
    # The housekeeper got to the dead worker's job before the stream did: the job is queued again, no
    # worker is live. The client hears what happened to its stream (worker_lost), not that the
    # model was never served (no_live_worker, the code for a job that never ran).
    stream = await _stream(redis_url, [START, DELTA_1], [START, DELTA_1], None, 0, 0.1, 0.1, requeued=True)
    async with asyncio.timeout(5):
        events = [event async for event in stream.events()]
    assert events[:2] == [START, DELTA_1]
    assert isinstance(events[-1], ErrorEvent) and events[-1].kind is ErrorKind.WORKER_LOST
    assert "stopped before it finished" in events[-1].message


async def test_after_the_subscription_was_renewed_the_log_fills_what_the_channel_missed(redis_url: str) -> None:
    # Live up to DELTA_1; the subscription broke and was renewed meanwhile (DELTA_2 and END were
    # published while this process listened nowhere); the log has every event, DELTA_1 again.
    stream = await _stream(redis_url, [START, DELTA_1, RENEWED], [START, DELTA_1, DELTA_2, END])
    async with asyncio.timeout(5):
        assert [event async for event in stream.events()] == [START, DELTA_1, DELTA_2, END]


async def test_after_a_renewal_the_live_events_that_the_log_also_had_are_not_repeated(redis_url: str) -> None:
    stream = await _stream(redis_url, [START, RENEWED, DELTA_1, DELTA_2, END], [START, DELTA_1, DELTA_2])
    async with asyncio.timeout(5):
        assert [event async for event in stream.events()] == [START, DELTA_1, DELTA_2, END]


@pytest.fixture
def own_redis() -> Iterator[RedisHandle]:
    """A Redis of the test's own, to freeze or kill."""
    binary = find_redis_server()
    assert binary is not None
    handle = start_redis(binary)
    try:
        yield handle
    finally:
        handle.stop()


def _signal(handle: RedisHandle, signum: int) -> None:
    assert handle.process is not None
    handle.process.send_signal(signum)


async def test_under_sentinel_a_stream_rides_out_redis_not_answering(own_redis: RedisHandle) -> None:
    # Redis frozen while the job is silent: every look at the job's record times out. Once Redis
    # answers again, the events written meanwhile come from the log; no error.
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    stream = await _stream(own_redis.url, [START], [START], None, 0, 0.2, keys=keys, **UNDER_SENTINEL)
    assert await stream.next_event() == START
    _signal(own_redis, signal.SIGSTOP)
    try:
        rest = asyncio.create_task(stream.next_event())
        await asyncio.sleep(3.0)  # past a command's timeout: the stream has met Redis not answering
        assert not rest.done()
    finally:
        _signal(own_redis, signal.SIGCONT)
    _append(own_redis.url, keys, [DELTA_1, DELTA_2, END])
    async with asyncio.timeout(10):
        assert await rest == DELTA_1
        assert [event async for event in stream.events()] == [DELTA_2, END]


async def test_with_one_redis_a_stream_ends_when_redis_does_not_answer(own_redis: RedisHandle) -> None:
    stream = await _stream(own_redis.url, [START], [START], None, 0, 0.2)
    assert await stream.next_event() == START
    _signal(own_redis, signal.SIGSTOP)
    try:
        with pytest.raises(RelayError) as raised:
            async with asyncio.timeout(10):
                await stream.next_event()
    finally:
        _signal(own_redis, signal.SIGCONT)
    assert raised.value.kind is ErrorKind.REDIS_UNAVAILABLE


async def test_under_sentinel_a_job_whose_record_redis_lost_ends_the_stream(own_redis: RedisHandle) -> None:
    # Redis comes back without the job (a replica promoted before it had the job): the job is
    # lost, and the stream says so instead of waiting for ever.
    stream = await _stream(own_redis.url, [START], [START], None, 0, 0.2, **UNDER_SENTINEL)
    assert await stream.next_event() == START
    reader = sync_redis.Redis.from_url(own_redis.url)
    try:
        reader.flushall()
    finally:
        reader.close()
    with pytest.raises(RelayError) as raised:
        async with asyncio.timeout(10):
            await stream.next_event()
    assert raised.value.kind is ErrorKind.INTERNAL and "failover lost it" in raised.value.message
