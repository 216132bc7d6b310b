"""JobRunner with transcription windows against a real Redis (the model is a stand-in): the audio
is read from its key, an expired one ends the job, a window another worker stopped in is finished
with the segments the log lacks, and refusals are published."""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest
from redis.asyncio import Redis

from shared.contract import encode_job
from shared.errors import ErrorKind
from shared.events import AnyEvent, ErrorEvent
from shared.job_lifecycle import Claim, JobLifecycle, JobState
from shared.redis import RedisTarget
from shared.redis_keys import RedisKeys
from tests.worker.transcription_helpers import EngineRun, events_of, stand_in_whisper, transcription_job, window_work
from worker.audio.engine import TranscriptionEngine
from worker.engine.engine import RequestOutput
from worker.kinds.transcribe import TranscriptionHandler
from worker.service.job_runner import JobRunner
from worker.service.publisher import EventPublisher

MODEL = "whisper-fake"
PCM = np.zeros(1600, dtype="<i2").tobytes()


@dataclass
class _Worker:
    lifecycle: JobLifecycle
    publisher: EventPublisher
    runner: JobRunner

    async def claim(self, worker_id: str) -> Claim:
        claim = await self.lifecycle.claim("q", worker_id, f"instance-{worker_id}")
        assert isinstance(claim, Claim)
        return claim


@pytest.fixture
async def worker(redis: Redis, redis_url: str) -> AsyncIterator[_Worker]:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    lifecycle = JobLifecycle(redis, keys)
    publisher = EventPublisher(RedisTarget(redis_url), keys)
    whisper = stand_in_whisper()
    engine = TranscriptionEngine(whisper, publisher.sink)
    thread = threading.Thread(target=engine.run_forever, daemon=True)
    thread.start()
    handler = TranscriptionHandler(whisper, engine)
    runner = JobRunner(lifecycle, "worker-b", MODEL, handler, publisher, 60.0)  # type: ignore[arg-type]
    yield _Worker(lifecycle, publisher, runner)
    engine.stop()
    thread.join(timeout=5)
    publisher.close()


async def _create(worker: _Worker, audio: bytes | None, **fields: object) -> str:
    job_id = f"transcr-{uuid.uuid4().hex}"
    if audio is not None:
        await worker.lifecycle.store_audio({job_id: audio})
    job = transcription_job(MODEL, job_id=job_id, **fields)
    await worker.lifecycle.create(job_id, encode_job(job), MODEL, "q")
    return job_id


def _dumps(events: list[AnyEvent]) -> list[dict[str, object]]:
    return [event.model_dump() for event in events]


async def test_a_window_runs_from_its_stored_audio(worker: _Worker) -> None:
    job_id = await _create(worker, PCM)
    await worker.runner.run(await worker.claim("worker-b"))
    whole = _whole_window(job_id, worker_id="worker-b")
    assert _dumps(await worker.lifecycle.read_log(job_id)) == _dumps(whole)
    record = await worker.lifecycle.record(job_id)
    assert record is not None and record.state is JobState.FINISHED


async def test_expired_audio_ends_the_job_with_an_error(worker: _Worker) -> None:
    job_id = await _create(worker, audio=None)
    await worker.runner.run(await worker.claim("worker-b"))
    events = await worker.lifecycle.read_log(job_id)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent) and events[0].kind is ErrorKind.EXPIRED
    assert events[0].message == "The audio of this job expired before a worker took it."
    record = await worker.lifecycle.record(job_id)
    assert record is not None and record.state is JobState.FAILED


async def test_a_refused_window_is_published_as_its_error(worker: _Worker) -> None:
    job_id = await _create(worker, PCM, translate=True)
    await worker.runner.run(await worker.claim("worker-b"))
    events = await worker.lifecycle.read_log(job_id)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent) and events[0].kind is ErrorKind.INVALID_REQUEST
    assert events[0].param == "model" and "cannot translate" in events[0].message


@pytest.mark.parametrize("num_sent", [2, 5])  # start and one segment; everything but the end event
async def test_a_window_another_worker_stopped_in_is_finished_without_repeats(worker: _Worker, num_sent: int) -> None:
    job_id = await _create(worker, PCM)
    whole = _whole_window(job_id, worker_id="worker-a")
    first = await worker.claim("worker-a")
    done = worker.publisher.expect(job_id, first.epoch)
    await worker.publisher.publish(RequestOutput(job_id, whole[:num_sent], False))
    worker.publisher.forget(job_id)
    assert not done.done() and await worker.lifecycle.requeue(job_id, first.epoch)

    second = await worker.claim("worker-b")
    assert second.next_seq == num_sent
    await worker.runner.run(second)
    assert _dumps(await worker.lifecycle.read_log(job_id)) == _dumps(whole)


def _whole_window(job_id: str, worker_id: str) -> list[AnyEvent]:
    """What one undisturbed attempt sends for the stand-in model."""
    run = EngineRun(stand_in_whisper())
    try:
        work = window_work(MODEL, np.zeros(1600), job_id=job_id)
        assert work.start_event is not None
        work.start_event = work.start_event.model_copy(update={"worker_id": worker_id})
        return events_of(run.outputs(work))
    finally:
        run.stop()
