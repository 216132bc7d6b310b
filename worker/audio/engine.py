"""Transcribe one window at a time with faster-whisper, sending each segment as it is made.

A window's text is the same on every run at temperature 0: one temperature (no fallback ladder),
beam search, no conditioning on text outside the window. That
is what lets a worker continue a window another worker died in: it transcribes the window again
and sends only the segments the job's log lacks (:class:`WindowResume`). Silero VAD (shipped with
faster-whisper) keeps only the speech, so silence gives no text rather than words Whisper invents.

Every submitted window ends with an output marked done, also when it was aborted or failed (see
:class:`InboxEngine`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from faster_whisper.transcribe import Segment, TranscriptionInfo  # type: ignore[import-untyped]  # no stubs, no py.typed

from shared.contract import Transcribe
from shared.errors import ErrorKind
from shared.events import (
    AnyEvent,
    EndEvent,
    ErrorEvent,
    SegmentEvent,
    StartEvent,
    TranscriptEvent,
    UsageCounts,
    WordTiming,
)
from worker.audio.loader import LoadedWhisper
from worker.engine.engine import RequestOutput
from worker.engine.inbox import InboxEngine

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
BEAM_SIZE = 5


@dataclass(frozen=True)
class WindowResume:
    """What earlier attempts at a window sent, from the job's log: where this attempt continues."""

    next_seq: int
    num_segments_sent: int
    num_tokens_sent: int  # the sent segments' tokens, for the end event's usage
    has_transcript: bool


@dataclass
class TranscriptionWork:
    request_id: str
    request: Transcribe
    samples: np.ndarray  # float32 in [-1, 1], 16 kHz mono
    start_event: StartEvent | None
    next_seq: int = 1  # the next event's seq (after the start event, if any); advances as events go out
    skip_segments: int = 0  # segments an earlier attempt already sent
    has_transcript: bool = False  # an earlier attempt also sent the transcript event
    priority: int = 0
    num_tokens: int = field(default=0, init=False)

    @property
    def num_prompt_tokens(self) -> int:
        return 0

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens

    @property
    def audio_s(self) -> float:
        return len(self.samples) / SAMPLE_RATE

    def continue_from(self, resume: WindowResume) -> None:
        self.next_seq = resume.next_seq
        self.skip_segments = resume.num_segments_sent
        self.has_transcript = resume.has_transcript
        if resume.has_transcript:
            self.num_tokens = resume.num_tokens_sent  # nothing is transcribed again


class TranscriptionEngine(InboxEngine[TranscriptionWork]):
    failure_message = "transcription failed inside the worker"

    def __init__(self, whisper: LoadedWhisper, sink: Callable[[list[RequestOutput]], None]) -> None:
        super().__init__(sink, max_running=1)
        self.whisper = whisper

    def _run(self, works: list[TranscriptionWork]) -> None:
        for work in works:
            self._run_window(work)

    def _run_window(self, work: TranscriptionWork) -> None:
        if work.start_event is not None:
            self._sink([RequestOutput(work.request_id, [work.start_event], False)])
            work.start_event = None  # sent
        if work.has_transcript:  # only the end event is missing
            self._finish(work, [])
            return
        segments, info = self._transcribe(work)
        num_segments = 0
        for index, segment in enumerate(segments):
            abort = self.aborted(work)
            if abort is not None:
                self._end(work, *abort)
                return
            num_segments += 1
            work.num_tokens += len(segment.tokens)
            if index < work.skip_segments:
                continue
            event = _segment_event(work.next_seq, index, segment)
            work.next_seq += 1
            self._sink([RequestOutput(work.request_id, [event], False)])
        transcript = TranscriptEvent(
            seq=work.next_seq,
            language=info.language,
            language_probability=float(info.language_probability),
            duration_s=work.audio_s,
            num_segments=num_segments,
        )
        work.next_seq += 1
        self._finish(work, [transcript])

    def _transcribe(self, work: TranscriptionWork) -> tuple[Iterator[Segment], TranscriptionInfo]:
        """A lazy iterator: each segment is decoded when it is asked for."""
        request = work.request
        if request.temperature > 0:
            import ctranslate2  # type: ignore[import-untyped]  # no stubs, no py.typed

            # Only the first sampled window of a process follows this seed: CTranslate2 seeds each
            # of its threads' generators once, when the thread first samples, and never again.
            ctranslate2.set_random_seed(request.seed)
        segments, info = self.whisper.model.transcribe(
            work.samples,
            language=request.language,
            task="translate" if request.translate else "transcribe",
            beam_size=BEAM_SIZE,
            temperature=[request.temperature],  # one temperature, no fallback: the same text on every run
            initial_prompt=request.prompt,
            condition_on_previous_text=False,
            word_timestamps=request.word_timestamps,
            # Silero VAD (shipped with faster-whisper): a silent window gives no text. Without it
            # whisper-tiny.en wrote " You" for 3 s of silence; on the LibriVox clips both gave 4.2% WER.
            vad_filter=True,
        )
        return segments, info

    def _finish(self, work: TranscriptionWork, events: list[AnyEvent]) -> None:
        usage = UsageCounts(prompt_tokens=0, completion_tokens=work.num_tokens)
        events.append(EndEvent(seq=work.next_seq, usage=usage))
        self._sink([RequestOutput(work.request_id, events, True)])

    def _end(self, work: TranscriptionWork, kind: ErrorKind | None, message: str) -> None:
        events: list[AnyEvent] = []
        if kind is not None:
            events = [] if work.start_event is None else [work.start_event]
            events.append(ErrorEvent(seq=work.next_seq, kind=kind, message=message))
        self._sink([RequestOutput(work.request_id, events, True)])


def _segment_event(seq: int, index: int, segment: Segment) -> SegmentEvent:
    words = None
    if segment.words is not None:
        words = [
            WordTiming(word=w.word, start=float(w.start), end=float(w.end), probability=float(w.probability))
            for w in segment.words
        ]
    return SegmentEvent(
        seq=seq,
        index=index,
        start=float(segment.start),
        end=float(segment.end),
        text=segment.text,
        tokens=list(segment.tokens),
        avg_logprob=float(segment.avg_logprob),
        compression_ratio=float(segment.compression_ratio),
        no_speech_prob=float(segment.no_speech_prob),
        temperature=float(segment.temperature or 0.0),
        words=words,
    )
