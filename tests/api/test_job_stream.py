"""Event ordering in the API's job stream against a real Redis: duplicates dropped, gaps filled
from the job's event log, and reported when the log does not have them either; a silent stream
reads what pub/sub dropped from the log; bytes that are not an event end the stream."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from api.jobs.event_router import EventRouter
from api.jobs.stream import JobStream, StreamServices
from api.jobs.worker_directory import WorkerDirectory
from api.metrics import Metrics
from api.request_metrics import RequestObserver
from api.settings import ApiSettings
from shared.contract import ChatJob, Generate, Message
from shared.errors import ErrorKind, RelayError
from shared.events import AnyEvent, DeltaEvent, EndEvent, ErrorEvent, StartEvent, UsageCounts, encode_event
from shared.job_lifecycle import AppendRequest, EventAppender, JobLifecycle, JobState
from shared.redis_keys import RedisKeys

JOB_ID = "chatcmpl-test"


async def _stream(
    redis_url: str,
    live: list[AnyEvent | bytes],
    logged: list[AnyEvent],
    backlog: list[AnyEvent] | None = None,
    next_seq: int = 0,
    liveness_check_interval_s: float = 30.0,
    no_worker_grace_s: float = 30.0,
    requeued: bool = False,
) -> JobStream:
    """A running job whose worker wrote ``logged`` and whose channel brought ``live``; with
    ``requeued``, then put back in its queue as the housekeeper does when that worker dies."""
    redis = Redis.from_url(redis_url)
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    await lifecycle.create(JOB_ID, b"{}", "m", keys.queue("m"))
    claim = await lifecycle.claim(keys.queue("m"), "w", "i")
    assert claim is not None
    if logged:
        appender = EventAppender(sync_redis.Redis.from_url(redis_url), keys)
        final = JobState.FINISHED if isinstance(logged[-1], EndEvent) else None
        appender.append([AppendRequest(JOB_ID, claim.epoch, [(e.seq, encode_event(e)) for e in logged], final)])
    if requeued:
        assert await lifecycle.requeue(JOB_ID, claim.epoch)
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for item in live:
        queue.put_nowait(item if isinstance(item, bytes) else encode_event(item))
    request = Generate(model="m", messages=[Message(role="user", content="x")])
    job = ChatJob(job_id=JOB_ID, created=1, request=request)
    observer = RequestObserver(Metrics(), "m", arrived_at=0.0)
    settings = ApiSettings(liveness_check_interval_s=liveness_check_interval_s, no_worker_grace_s=no_worker_grace_s)
    services = StreamServices(lifecycle, EventRouter(redis, keys), WorkerDirectory(redis, keys), settings)
    return JobStream(services, job, queue, None, observer, backlog, next_seq)


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
