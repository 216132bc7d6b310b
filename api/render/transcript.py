"""A recording's windows, stitched in order, rendered in each of OpenAI's audio formats.

Workers give each window's segments and words in the window's own time; here they move to the
recording's time (plus the window's offset), segments are numbered across windows, and the text
is the segments' text joined, as Whisper joins it, without the whitespace around the whole.

The text grows here alone, one segment at a time, and each segment's growth is what a stream
sends as its delta: so the deltas joined are the final text, byte for byte, across windows too."""

from __future__ import annotations

from dataclasses import dataclass, field

from api.render.languages import language_name
from api.wire.openai.audio import (
    Transcription,
    TranscriptionSegment,
    TranscriptionTextDoneEvent,
    TranscriptionVerbose,
    TranscriptionWord,
    Translation,
    TranslationVerbose,
    UsageDuration,
    UsageTokens,
)
from shared.events import SegmentEvent, TranscriptEvent


@dataclass
class Transcript:
    task: str  # "transcribe" or "translate"
    duration_s: float
    segments: list[TranscriptionSegment] = field(default_factory=list)
    words: list[TranscriptionWord] = field(default_factory=list)
    language: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    text: str = field(default="", init=False)  # the segments' text joined, stripped; grown by add_segment alone
    # Whitespace after the text so far: the text's end, unless more text follows it.
    _held_space: str = field(default="", init=False, repr=False)

    def add_segment(self, offset_s: float, event: SegmentEvent) -> str:
        """Fold in a window's segment; returns what it adds to :attr:`text` (a stream's delta)."""
        segment = TranscriptionSegment(
            id=len(self.segments),
            seek=round(offset_s * 100),
            start=_time(offset_s + event.start),
            end=_time(offset_s + event.end),
            text=event.text,
            tokens=event.tokens,
            temperature=event.temperature,
            avg_logprob=event.avg_logprob,
            compression_ratio=event.compression_ratio,
            no_speech_prob=event.no_speech_prob,
        )
        self.segments.append(segment)
        for word in event.words or []:
            self.words.append(
                TranscriptionWord(word=word.word, start=_time(offset_s + word.start), end=_time(offset_s + word.end))
            )
        return self._extend_text(event.text)

    def _extend_text(self, piece: str) -> str:
        """Whisper's segments start with a space; the text starts with none, and whitespace after
        a segment waits until some text follows it (until then it may be the text's end)."""
        pending = self._held_space + piece
        if not self.text:
            pending = pending.lstrip()
        added = pending.rstrip()
        self._held_space = pending[len(added) :]
        self.text += added
        return added

    def add_summary(self, event: TranscriptEvent) -> None:
        """The first window's language names the recording's."""
        self.language = self.language or event.language

    def add_usage(self, num_input_tokens: int, num_output_tokens: int) -> None:
        self.num_input_tokens += num_input_tokens
        self.num_output_tokens += num_output_tokens

    @property
    def is_translation(self) -> bool:
        return self.task == "translate"

    @property
    def usage(self) -> UsageDuration:
        return UsageDuration(seconds=round(self.duration_s, 3))

    def as_json(self) -> Transcription | Translation:
        if self.is_translation:
            return Translation(text=self.text)
        return Transcription(text=self.text, usage=self.usage)

    def as_verbose(self, with_words: bool) -> TranscriptionVerbose | TranslationVerbose:
        duration = round(self.duration_s, 3)
        if self.is_translation:
            return TranslationVerbose(duration=duration, text=self.text, segments=self.segments)
        return TranscriptionVerbose(
            language=language_name(self.language or "en"),
            duration=duration,
            text=self.text,
            segments=self.segments,
            words=self.words if with_words else None,
            usage=self.usage,
        )

    def as_text(self) -> str:
        return self.text + "\n"

    def as_done_event(self) -> TranscriptionTextDoneEvent:
        num_input, num_output = self.num_input_tokens, self.num_output_tokens
        usage = UsageTokens(input_tokens=num_input, output_tokens=num_output, total_tokens=num_input + num_output)
        return TranscriptionTextDoneEvent(text=self.text, usage=usage)

    def as_srt(self) -> str:
        """Numbered cues from 1, ``00:00:01,500`` times, a blank line after each."""
        return "".join(
            f"{number}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n"
            for number, s in enumerate(self.segments, start=1)
        )

    def as_vtt(self) -> str:
        """A ``WEBVTT`` header, then ``00:00:01.500`` cues, a blank line after each."""
        cues = "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n" for s in self.segments)
        return f"WEBVTT\n\n{cues}"


def _time(seconds: float) -> float:
    return round(seconds, 3)


def _clock(seconds: float, decimal_mark: str) -> str:
    """``HH:MM:SS,mmm`` (SRT) or ``HH:MM:SS.mmm`` (WebVTT)."""
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_mark}{millis:03d}"
