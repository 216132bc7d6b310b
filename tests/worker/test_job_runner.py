"""JobRunner against a real Redis: a job its worker cannot prepare still ends with an error event.

The handler here is a stand-in that fails on purpose (a real one fails this way only through a
bug); the Redis, publisher and event log are the real ones.
"""

from __future__ import annotations

import uuid

from redis.asyncio import Redis

from shared.errors import ErrorKind, RelayError
from shared.events import ErrorEvent
from shared.job_lifecycle import JobLifecycle, JobState
from shared.jobs import AnyJob, ChatJob, encode_job
from shared.openai.chat_request import ChatCompletionRequest
from shared.redis_keys import RedisKeys
from worker.engine.sequence import ResumeState
from worker.job_runner import JobRunner
from worker.publisher import EventPublisher

MODEL = "runner-model"


class _FailingHandler:
    """Raises ``error`` from ``prepare``; it never reaches an engine."""

    engine = None

    def __init__(self, error: Exception) -> None:
        self.error = error

    def prepare(self, job: AnyJob, resume: ResumeState | None) -> object:
        raise self.error


async def _run_failing_job(redis: Redis, redis_url: str, error: Exception) -> ErrorEvent:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    await lifecycle.create(job_id, encode_job(ChatJob(job_id=job_id, created=0, request=request)), MODEL, "q")
    claim = await lifecycle.claim("q", "worker-a", "instance-a")
    assert claim is not None
    publisher = EventPublisher(redis_url, keys)
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
