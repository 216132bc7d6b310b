"""Event ordering in the API's job stream against a real Redis: duplicates dropped, gaps filled
from the job's event log, and reported when the log does not have them either; a silent stream
reads what pub/sub dropped from the log, and ends when the job's run ended without a result."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from arq.constants import result_key_prefix
from redis.asyncio import Redis

from api.job_stream import JobStream
from api.metrics import Metrics
from api.request_metrics import RequestObserver
from api.settings import ApiSettings
from shared.errors import ErrorKind, RelayError
from shared.events import AnyEvent, DeltaEvent, EndEvent, StartEvent, UsageCounts, encode_event
from shared.jobs import ChatJob
from shared.openai.chat_request import ChatCompletionRequest
from shared.redis_keys import RedisKeys

JOB_ID = "chatcmpl-test"


class _Submitter:
    """The parts of JobSubmitter a stream reads before it would ask about workers."""

    def __init__(self, redis: Redis, keys: RedisKeys, liveness_check_interval_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = ApiSettings(liveness_check_interval_s=liveness_check_interval_s, no_worker_grace_s=30.0)


async def _stream(
    redis_url: str,
    live: list[AnyEvent],
    logged: list[AnyEvent],
    backlog: list[AnyEvent] | None = None,
    next_seq: int = 0,
    liveness_check_interval_s: float = 30.0,
    arq_result: bool = False,
) -> JobStream:
    """``arq_result``: the job's arq run is over (arq stored its result)."""
    redis = Redis.from_url(redis_url)
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    if arq_result:
        await redis.set(keys.job_arq_id(JOB_ID), f"{keys.prefix}-arq")
        await redis.set(f"{result_key_prefix}{keys.prefix}-arq", b"done")
    for event in logged:
        await redis.xadd(keys.job_event_log(JOB_ID), {"e": encode_event(event)})
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for event in live:
        queue.put_nowait(encode_event(event))
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    job = ChatJob(job_id=JOB_ID, created=1, request=request)
    observer = RequestObserver(Metrics(), "m", arrived_at=0.0)
    submitter = _Submitter(redis, keys, liveness_check_interval_s)
    return JobStream(submitter, job, queue, None, observer, backlog, next_seq)  # type: ignore[arg-type]


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


async def test_a_job_whose_run_ended_without_a_final_event_ends_the_stream(redis_url: str) -> None:
    stream = await _stream(redis_url, [START], [START], None, 0, 0.2, arq_result=True)
    assert await stream.next_event() == START
    async with asyncio.timeout(5):
        with pytest.raises(RelayError) as raised:
            await stream.next_event()
    assert raised.value.kind is ErrorKind.INTERNAL
