"""/v1/audio/* against a real API process and Redis: validation errors in OpenAI's shape, the
upload limit (413), and a recording cut into window jobs that a stand-in Whisper worker answers,
stitched back in order (JSON, verbose JSON, SSE) with each window's samples deleted after."""

from __future__ import annotations

import asyncio
import io
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis as sync_redis
from redis.asyncio import Redis

from shared.contract import TranscriptionJob, decode_job
from shared.errors import ErrorKind
from shared.events import (
    AnyEvent,
    EndEvent,
    ErrorEvent,
    SegmentEvent,
    StartEvent,
    TranscriptEvent,
    UsageCounts,
    encode_event,
)
from shared.job_lifecycle import AppendRequest, Claim, EventAppender, JobLifecycle, JobState
from shared.registry import WorkerInfo, WorkerTask
from tests.support.stack import Stack

WHISPER = "fake-whisper"
CHAT = "fake-chat"
MAX_AUDIO_BYTES = 4 * 2**20
RATE = 16_000


def _wav(seconds: float) -> bytes:
    """A tone with a short silence every 7 s, so that windows are cut in silences."""
    t = np.arange(int(seconds * RATE)) / RATE
    samples = (8000 * np.sin(2 * np.pi * 300 * t)).astype(np.int16)
    samples[(t % 7.0) < 0.2] = 0
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(samples.astype("<i2").tobytes())
    return buffer.getvalue()


class FakeWhisper:
    """Registers as a live worker of ``model`` and answers each window job with one segment,
    ``" Window N."`` (0.5-1.0 s into the window), or fails window ``fail_window``."""

    def __init__(
        self,
        stack: Stack,
        model: str,
        task: WorkerTask,
        fail_window: int | None = None,
        delay_s: float = 0.0,
        is_claiming: bool = True,
        english_only: bool = False,
    ) -> None:
        """``is_claiming``: False: live, but it takes no job (they wait in the queue);
        ``english_only``: its registry record says so, as a worker of an English-only Whisper model's does."""
        self.stack, self.model, self.fail_window, self.delay_s = stack, model, fail_window, delay_s
        self.is_claiming = is_claiming
        self.worker_id = f"{stack.key_prefix}-{model}"
        self.jobs: list[TranscriptionJob] = []
        self.audio_bytes: dict[str, int] = {}
        self._stop = threading.Event()
        self._redis = sync_redis.Redis.from_url(stack.redis_url)
        now = time.time()
        info = WorkerInfo(
            worker_id=self.worker_id, model=model, task=task, state="ready", host="test", pid=1,
            started_at=now, heartbeat_at=now, contract_version=2, english_only=english_only,
        )  # fmt: skip
        self._redis.set(stack.keys.worker(self.worker_id), info.model_dump_json(), ex=600)
        self._redis.sadd(stack.keys.model_workers(model), self.worker_id)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._redis.delete(self.stack.keys.worker(self.worker_id))
        self._redis.srem(self.stack.keys.model_workers(self.model), self.worker_id)

    async def _serve(self) -> None:
        keys = self.stack.keys
        lifecycle = JobLifecycle(Redis.from_url(self.stack.redis_url), keys)
        appender = EventAppender(self._redis, keys)
        while not self._stop.is_set():
            if not self.is_claiming:
                await asyncio.sleep(0.01)
                continue
            claim = await lifecycle.claim(keys.queue(self.model), self.worker_id, "i")
            if not isinstance(claim, Claim):
                await asyncio.sleep(0.01)
                continue
            job = decode_job(claim.payload)
            assert isinstance(job, TranscriptionJob)
            self.jobs.append(job)
            self.audio_bytes[job.job_id] = len(await lifecycle.read_audio(job.job_id) or b"")
            await asyncio.sleep(self.delay_s)
            events, final = self._answer(job)
            appender.append([AppendRequest(job.job_id, claim.epoch, [(e.seq, encode_event(e)) for e in events], final)])

    def _answer(self, job: TranscriptionJob) -> tuple[list[AnyEvent], JobState]:
        window = job.request.window
        start = StartEvent(seq=0, worker_id=self.worker_id, prompt_tokens=0)
        if window == self.fail_window:
            error = ErrorEvent(seq=1, kind=ErrorKind.INVALID_REQUEST, message="English-only model cannot translate")
            return [start, error], JobState.FAILED
        return [
            start,
            SegmentEvent(seq=1, index=0, start=0.5, end=1.0, text=f" Window {window}.", tokens=[1, 2, 3]),
            TranscriptEvent(seq=2, language="en", duration_s=job.request.duration_s, num_segments=1),
            EndEvent(seq=3, usage=UsageCounts(prompt_tokens=0, completion_tokens=3)),
        ], JobState.FINISHED


@pytest.fixture(scope="module")
def audio_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(redis_url=redis_url, log_dir=Path(tmp_path_factory.mktemp("audio-logs")))
    try:
        stack.start_api(max_audio_bytes=MAX_AUDIO_BYTES, max_audio_seconds=120, audio_window_s=30)
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def whisper(audio_stack: Stack) -> Iterator[FakeWhisper]:
    worker = FakeWhisper(audio_stack, WHISPER, "transcribe")
    yield worker
    worker.stop()


def _post(
    stack: Stack, fields: dict[str, str], audio: bytes | None = b"", path: str = "transcriptions"
) -> httpx.Response:
    files = {"file": ("speech.wav", audio, "audio/wav")} if audio is not None else None
    data = {"model": WHISPER, **fields}
    return httpx.post(f"{stack.base_url}/v1/audio/{path}", data=data, files=files, timeout=30)


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


@pytest.mark.parametrize(
    ("fields", "path", "param"),
    [
        ({"response_format": "xml"}, "transcriptions", "response_format"),
        ({"timestamp_granularities[]": "word"}, "transcriptions", "timestamp_granularities"),
        ({"timestamp_granularities[]": "letter", "response_format": "verbose_json"}, "transcriptions",
         "timestamp_granularities"),
        ({"stream": "true", "response_format": "srt"}, "transcriptions", "stream"),
        ({"stream": "maybe"}, "transcriptions", "stream"),
        ({"temperature": "1.5"}, "transcriptions", "temperature"),
        ({"language": "de"}, "translations", "language"),
        ({"stream": "true"}, "translations", "stream"),
        ({"model": ""}, "transcriptions", "model"),
    ],
)  # fmt: skip
def test_invalid_fields_are_400_naming_the_param(
    audio_stack: Stack, fields: dict[str, str], path: str, param: str
) -> None:
    error = _error(_post(audio_stack, fields, _wav(1.0), path), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_a_missing_file_is_400_naming_file(audio_stack: Stack) -> None:
    assert _error(_post(audio_stack, {}, audio=None), 400)["param"] == "file"


def test_an_upload_over_the_limit_is_413(audio_stack: Stack) -> None:
    assert _post(audio_stack, {}, b"\0" * (MAX_AUDIO_BYTES + 128 * 1024)).status_code == 413


def test_an_upload_over_the_limit_without_content_length_is_413(audio_stack: Stack) -> None:
    boundary = "b0undary"
    head = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'.encode()
    tail = f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{WHISPER}\r\n--{boundary}--\r\n'

    def body() -> Iterator[bytes]:
        yield head
        for _ in range(MAX_AUDIO_BYTES // 2**20 + 1):
            yield b"\0" * 2**20
        yield tail.encode()

    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    response = httpx.post(f"{audio_stack.base_url}/v1/audio/transcriptions", content=body(), headers=headers)
    assert response.status_code == 413


def test_an_unknown_model_is_404(audio_stack: Stack) -> None:
    assert _error(_post(audio_stack, {"model": "nobody"}, _wav(1.0)), 404)["param"] == "model"


def test_a_chat_model_is_400_naming_model(audio_stack: Stack) -> None:
    chat = FakeWhisper(audio_stack, CHAT, "generate")
    try:
        error = _error(_post(audio_stack, {"model": CHAT}, _wav(1.0)), 400)
    finally:
        chat.stop()
    assert error["param"] == "model"
    assert "not audio transcription" in str(error["message"])


@pytest.mark.parametrize("audio", [b"not audio, only words", b"\x00" * 2048])
def test_what_is_not_audio_is_400_naming_file(audio_stack: Stack, whisper: FakeWhisper, audio: bytes) -> None:
    assert _error(_post(audio_stack, {}, audio), 400)["param"] == "file"
    assert whisper.jobs == []


def test_audio_longer_than_the_limit_is_400_naming_file(audio_stack: Stack, whisper: FakeWhisper) -> None:
    error = _error(_post(audio_stack, {}, _wav(121.0)), 400)
    assert error["param"] == "file" and "max-audio-seconds" in str(error["message"])


def test_a_long_recording_is_cut_into_window_jobs_and_stitched_in_order(
    audio_stack: Stack, whisper: FakeWhisper
) -> None:
    response = _post(audio_stack, {"response_format": "verbose_json", "timestamp_granularities[]": "segment"},
                     _wav(70.0))  # fmt: skip
    assert response.status_code == 200, response.text
    answer = response.json()
    jobs = sorted(whisper.jobs, key=lambda job: job.request.window)
    assert len(jobs) == 3
    assert [job.job_id[-6:] for job in jobs] == ["-w0000", "-w0001", "-w0002"]
    assert all(job.job_id.startswith("trsc-") for job in jobs)
    assert {job.request.num_windows for job in jobs} == {3}
    assert all(whisper.audio_bytes[job.job_id] == round(job.request.duration_s * RATE) * 2 for job in jobs)
    assert answer["text"] == "Window 0. Window 1. Window 2."
    assert answer["duration"] == 70.0 and answer["language"] == "english"
    segments = answer["segments"]
    assert [s["id"] for s in segments] == [0, 1, 2]
    assert [s["start"] for s in segments] == [round(job.request.offset_s + 0.5, 3) for job in jobs]
    assert answer["usage"] == {"type": "duration", "seconds": 70.0}
    keys = audio_stack.keys
    redis = sync_redis.Redis.from_url(audio_stack.redis_url)
    assert not any(redis.exists(keys.job_audio(job.job_id)) for job in jobs)


@pytest.mark.parametrize(
    ("response_format", "body", "content_type"),
    [
        ("json", '{"text":"Window 0.","usage":{"type":"duration","seconds":1.0}}', "application/json"),
        ("text", "Window 0.\n", "text/plain"),
        ("srt", "1\n00:00:00,500 --> 00:00:01,000\nWindow 0.\n\n", "text/plain"),
        ("vtt", "WEBVTT\n\n00:00:00.500 --> 00:00:01.000\nWindow 0.\n\n", "text/plain"),
    ],
)
def test_each_response_format(
    audio_stack: Stack, whisper: FakeWhisper, response_format: str, body: str, content_type: str
) -> None:
    response = _post(audio_stack, {"response_format": response_format}, _wav(1.0))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(content_type)
    assert response.text == body


def test_a_translation_is_a_translate_job_answered_as_openai_does(audio_stack: Stack, whisper: FakeWhisper) -> None:
    response = _post(audio_stack, {}, _wav(1.0), path="translations")
    assert response.json() == {"text": "Window 0."}
    assert [job.request.translate for job in whisper.jobs] == [True]


def test_the_stream_sends_a_delta_per_segment_then_done(audio_stack: Stack, whisper: FakeWhisper) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{audio_stack.base_url}/v1", api_key="unused", max_retries=0)
    events = list(client.audio.transcriptions.create(model=WHISPER, file=("a.wav", _wav(50.0)), stream=True))
    assert [e.type for e in events] == ["transcript.text.delta", "transcript.text.delta", "transcript.text.done"]
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert deltas == ["Window 0.", " Window 1."]  # the first segment's leading space is not part of the text
    done = events[-1]
    assert done.type == "transcript.text.done" and done.text == "".join(deltas)
    assert done.usage is not None and done.usage.output_tokens == 6


def test_a_window_refused_by_the_worker_is_an_http_400(audio_stack: Stack) -> None:
    refusing = FakeWhisper(audio_stack, WHISPER, "transcribe", fail_window=0)
    try:
        error = _error(_post(audio_stack, {}, _wav(50.0), path="translations"), 400)
    finally:
        refusing.stop()
    assert "English-only" in str(error["message"])
    redis = sync_redis.Redis.from_url(audio_stack.redis_url)
    assert not any(redis.exists(audio_stack.keys.job_audio(job.job_id)) for job in refusing.jobs)


@pytest.mark.parametrize(
    ("path", "fields", "param", "message"),
    [
        ("translations", {}, "model", f"Model `{WHISPER}` is English-only; it cannot translate."),
        ("transcriptions", {"language": "de"}, "language",
         f"Model `{WHISPER}` is English-only; the language must be `en`, not `de`."),
    ],
)  # fmt: skip
def test_an_english_only_model_is_refused_by_the_api_before_any_job(
    audio_stack: Stack, path: str, fields: dict[str, str], param: str, message: str
) -> None:
    english = FakeWhisper(audio_stack, WHISPER, "transcribe", english_only=True)
    try:
        error = _error(_post(audio_stack, fields, _wav(50.0), path=path), 400)
        english_transcript = _post(audio_stack, {"language": "en"}, _wav(1.0))
    finally:
        english.stop()
    assert (error["type"], error["param"], error["message"]) == ("invalid_request_error", param, message)
    assert [job.request.translate for job in english.jobs] == [False]  # the English transcription alone
    assert english_transcript.json()["text"] == "Window 0."


def test_a_recording_takes_one_of_its_keys_request_slots(redis_url: str, tmp_path: Path) -> None:
    """With a limit of one open request per key, a three-window recording still runs: its
    windows wait in the queue together, the first alone counting towards the key's limit."""
    stack = Stack(redis_url=redis_url, log_dir=tmp_path)
    stack.start_api(api_keys="sk-audio", max_requests_per_key=1, audio_window_s=30)
    slow = FakeWhisper(stack, WHISPER, "transcribe", delay_s=0.3)
    try:
        response = httpx.post(
            f"{stack.base_url}/v1/audio/transcriptions", data={"model": WHISPER},
            files={"file": ("a.wav", _wav(70.0), "audio/wav")}, headers={"authorization": "Bearer sk-audio"},
            timeout=30,
        )  # fmt: skip
    finally:
        slow.stop()
        stack.stop()
    assert response.status_code == 200, response.text
    assert response.json()["text"] == "Window 0. Window 1. Window 2."
    assert len({job.tenant for job in slow.jobs}) == 1 and slow.jobs[0].tenant


def test_a_full_queue_cancels_the_windows_already_queued(redis_url: str, tmp_path: Path) -> None:
    stack = Stack(redis_url=redis_url, log_dir=tmp_path)
    stack.start_api(max_pending_per_model=2, audio_window_s=30)
    idle = FakeWhisper(stack, WHISPER, "transcribe", is_claiming=False)
    redis = sync_redis.Redis.from_url(stack.redis_url)
    try:
        response = _post(stack, {}, _wav(70.0))
        queued = redis.zcard(stack.keys.queue(WHISPER))
        audio_keys = list(redis.scan_iter(match=stack.keys.job_audio("*")))
    finally:
        idle.stop()
        stack.stop()
    assert _error(response, 429)["code"] == "queue_full"
    assert (queued, audio_keys) == (0, [])
