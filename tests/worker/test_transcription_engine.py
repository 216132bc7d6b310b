"""The transcription engine's event stream and the Whisper handler's refusals, with a stand-in
model (segments made up, so these run in milliseconds); tests/worker/test_whisper_tiny.py runs
the real whisper-tiny.en."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shared.contract import ChatJob, Embed, EmbeddingJob, Generate, Message
from shared.errors import ErrorKind, RelayError
from shared.events import EndEvent, ErrorEvent, SegmentEvent, StartEvent, TranscriptEvent
from tests.worker.transcription_helpers import (
    TEXTS,
    EngineRun,
    StandInModel,
    events_of,
    stand_in_whisper,
    transcription_job,
    window_work,
)
from worker.audio.engine import TranscriptionEngine, WindowResume
from worker.embedding.engine import EmbeddingEngine
from worker.embedding.loader import LoadedEmbedder
from worker.kinds.embed import EmbeddingHandler
from worker.kinds.generate import GenerationHandler
from worker.kinds.transcribe import TranscriptionHandler

MODEL = "whisper-fake"


@pytest.fixture
def run() -> Iterator[EngineRun]:
    engine_run = EngineRun(stand_in_whisper())
    yield engine_run
    engine_run.stop()


def _model_of(run: EngineRun) -> StandInModel:
    model = run.engine.whisper.model
    assert isinstance(model, StandInModel)
    return model


def test_each_segment_goes_out_as_it_is_made_then_the_transcript_and_the_end(run: EngineRun) -> None:
    outputs = run.outputs(window_work(MODEL, np.zeros(16_000)))
    assert [len(output.events) for output in outputs] == [1, 1, 1, 1, 2]  # start, 3 segments, transcript + end
    assert [output.is_done for output in outputs] == [False] * 4 + [True]
    events = events_of(outputs)
    assert [event.seq for event in events] == list(range(6))
    assert isinstance(events[0], StartEvent)
    segments = [event for event in events if isinstance(event, SegmentEvent)]
    assert [(s.index, s.text, s.tokens) for s in segments] == [(i, t, [100 + i, 200 + i]) for i, t in enumerate(TEXTS)]
    transcript, end = events[4], events[5]
    assert isinstance(transcript, TranscriptEvent) and transcript.num_segments == 3 and transcript.duration_s == 1.0
    assert isinstance(end, EndEvent) and (end.usage.prompt_tokens, end.usage.completion_tokens) == (0, 6)


def test_decoding_is_one_temperature_without_conditioning(run: EngineRun) -> None:
    run.outputs(window_work(MODEL, np.zeros(1600), translate=False, prompt="Dashwood", temperature=0.0))
    options = _model_of(run).calls[-1]
    assert options["temperature"] == [0.0] and options["beam_size"] == 5 and options["initial_prompt"] == "Dashwood"
    assert options["task"] == "transcribe" and options["condition_on_previous_text"] is False


def test_a_continued_window_sends_only_the_segments_the_log_lacks(run: EngineRun) -> None:
    whole = events_of(run.outputs(window_work(MODEL, np.zeros(1600))))
    resume = WindowResume(next_seq=2, num_segments_sent=1, num_tokens_sent=2, has_transcript=False)
    rest = events_of(run.outputs(window_work(MODEL, np.zeros(1600), resume=resume)))
    assert [event.model_dump() for event in whole[:2] + rest] == [event.model_dump() for event in whole]


def test_a_window_whose_transcript_was_sent_gets_only_its_end(run: EngineRun) -> None:
    resume = WindowResume(next_seq=5, num_segments_sent=3, num_tokens_sent=6, has_transcript=True)
    events = events_of(run.outputs(window_work(MODEL, np.zeros(1600), resume=resume)))
    assert len(events) == 1 and isinstance(events[0], EndEvent)
    assert events[0].seq == 5 and events[0].usage.completion_tokens == 6
    assert _model_of(run).calls == []  # nothing transcribed again


def test_an_abort_between_segments_ends_the_window_with_its_error(run: EngineRun) -> None:
    model = _model_of(run)
    model.gate = threading.Event()
    work = window_work(MODEL, np.zeros(1600))
    run.engine.submit(work)
    first = [run._outputs.get(timeout=10) for _ in range(2)]  # start, first segment
    run.engine.abort(work.request_id, ErrorKind.JOB_TIMEOUT, "too slow")
    model.gate.set()
    last = run._outputs.get(timeout=10)
    assert [type(e) for o in first for e in o.events] == [StartEvent, SegmentEvent]
    assert last.is_done and len(last.events) == 1 and isinstance(last.events[0], ErrorEvent)
    assert last.events[0].kind is ErrorKind.JOB_TIMEOUT and last.events[0].seq == 2


def test_a_failing_window_ends_with_an_internal_error_and_the_next_runs(run: EngineRun) -> None:
    model = _model_of(run)
    model.fail = True
    failed = events_of(run.outputs(window_work(MODEL, np.zeros(1600), job_id="bad")))
    assert isinstance(failed[-1], ErrorEvent) and failed[-1].kind is ErrorKind.INTERNAL and failed[-1].seq == 1
    assert "exploded" not in failed[-1].message
    model.fail = False
    assert isinstance(events_of(run.outputs(window_work(MODEL, np.zeros(1600), job_id="good")))[-1], EndEvent)


# -- the handler ------------------------------------------------------------------------------


def _handler(is_multilingual: bool) -> TranscriptionHandler:
    whisper = stand_in_whisper(is_multilingual)
    return TranscriptionHandler(whisper, TranscriptionEngine(whisper, lambda outputs: None))


def _refusal(handler: TranscriptionHandler, **fields: Any) -> RelayError:
    with pytest.raises(RelayError) as refused:
        handler.prepare_window(transcription_job("whisper-tiny.en", **fields), b"\x00\x00" * 160, None)
    return refused.value


def test_an_english_only_model_refuses_to_translate_or_other_languages() -> None:
    handler = _handler(is_multilingual=False)
    translate = _refusal(handler, translate=True)
    assert translate.kind is ErrorKind.INVALID_REQUEST and translate.param == "model"
    assert translate.message == "Model `whisper-tiny.en` is English-only; it cannot translate."
    german = _refusal(handler, language="de")
    assert german.kind is ErrorKind.INVALID_REQUEST and german.param == "language" and "English-only" in german.message
    work = handler.prepare_window(transcription_job(MODEL, language="en"), b"\x00\x40" * 160, None)
    assert work.samples.dtype == np.float32 and work.samples.shape == (160,) and work.samples[0] == 0.5


def test_a_multilingual_model_refuses_unknown_language_codes_only() -> None:
    handler = _handler(is_multilingual=True)
    unknown = _refusal(handler, language="xx")
    assert unknown.param == "language" and "`xx`" in unknown.message
    handler.prepare_window(transcription_job(MODEL, language="de", translate=True), b"", None)


async def test_each_worker_refuses_the_others_jobs() -> None:
    chat = ChatJob(job_id="c", created=0, request=Generate(model="m", messages=[Message(role="user", content="hi")]))
    embedding = EmbeddingJob(job_id="e", created=0, request=Embed(model="m", inputs=["hi"]))
    for job in (chat, embedding):
        with pytest.raises(RelayError, match="serves audio transcription only") as refused:
            await _handler(is_multilingual=False).prepare(job, None)  # type: ignore[arg-type]  # read nothing
        assert refused.value.kind is ErrorKind.INVALID_REQUEST and refused.value.param == "model"
    window = transcription_job("m")
    embedder = LoadedEmbedder(None, None, "mean", True, 16, 4, "x")  # type: ignore[arg-type]
    embeddings = EmbeddingHandler(embedder, EmbeddingEngine(embedder, lambda outputs: None))
    with pytest.raises(RelayError, match="Model `m` serves embeddings only"):
        await embeddings.prepare(window, None)  # type: ignore[arg-type]
    generation = GenerationHandler(None, None, SimpleNamespace(max_running=1))  # type: ignore[arg-type]
    with pytest.raises(RelayError, match="Model `m` serves chat and text completions only"):
        await generation.prepare(window, None)  # type: ignore[arg-type]
