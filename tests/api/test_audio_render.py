"""Stitching windows into one transcript and rendering it in each of OpenAI's formats."""

from __future__ import annotations

import pytest

from api.render.transcript import Transcript
from shared.events import SegmentEvent, TranscriptEvent, WordTiming


def _segment(index: int, start: float, end: float, text: str, words: list[WordTiming] | None = None) -> SegmentEvent:
    return SegmentEvent(seq=index + 1, index=index, start=start, end=end, text=text, tokens=[1, 2], words=words)


def _two_windows(task: str = "transcribe") -> Transcript:
    """Window 0 (0-25.5 s) with two segments, window 1 (from 25.5 s) with one."""
    transcript = Transcript(task, duration_s=40.25)
    hello = WordTiming(word=" Hello", start=0.0, end=0.5, probability=0.9)
    fine = WordTiming(word=" Fine.", start=0.3, end=0.8, probability=0.8)
    transcript.add_segment(0.0, _segment(0, 0.0, 1.5, " Hello there.", [hello]))
    transcript.add_segment(0.0, _segment(1, 1.5, 25.0, " How are you?"))
    transcript.add_summary(TranscriptEvent(seq=3, language="en", duration_s=25.5, num_segments=2))
    transcript.add_segment(25.5, _segment(0, 0.25, 3.75, " Fine.", [fine]))
    transcript.add_summary(TranscriptEvent(seq=2, language="de", duration_s=14.75, num_segments=1))
    return transcript


def test_verbose_json_offsets_later_windows_and_numbers_segments_across_windows() -> None:
    verbose = _two_windows().as_verbose(with_words=True).model_dump(exclude_none=True)
    assert verbose["task"] == "transcribe"
    assert verbose["language"] == "english"  # the first window's, by name
    assert verbose["duration"] == 40.25
    assert verbose["text"] == "Hello there. How are you? Fine."
    segments = verbose["segments"]
    assert [s["id"] for s in segments] == [0, 1, 2]
    assert [(s["start"], s["end"]) for s in segments] == [(0.0, 1.5), (1.5, 25.0), (25.75, 29.25)]
    assert [s["seek"] for s in segments] == [0, 0, 2550]
    assert verbose["words"] == [
        {"word": " Hello", "start": 0.0, "end": 0.5},
        {"word": " Fine.", "start": 25.8, "end": 26.3},
    ]
    assert verbose["usage"] == {"type": "duration", "seconds": 40.25}


def test_words_only_when_asked_for() -> None:
    assert "words" not in _two_windows().as_verbose(with_words=False).model_dump(exclude_none=True)


def test_json_is_text_and_duration_usage() -> None:
    answer = _two_windows().as_json().model_dump(exclude_none=True)
    assert answer == {"text": "Hello there. How are you? Fine.", "usage": {"type": "duration", "seconds": 40.25}}


def test_translations_answer_as_openai_translations_do() -> None:
    transcript = _two_windows("translate")
    assert transcript.as_json().model_dump(exclude_none=True) == {"text": "Hello there. How are you? Fine."}
    verbose = transcript.as_verbose(with_words=True).model_dump(exclude_none=True)
    assert (verbose["task"], verbose["language"]) == ("translate", "english")
    assert "words" not in verbose and "usage" not in verbose


def test_srt_numbers_cues_from_1_with_comma_milliseconds() -> None:
    assert _two_windows().as_srt() == (
        "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
        "2\n00:00:01,500 --> 00:00:25,000\nHow are you?\n\n"
        "3\n00:00:25,750 --> 00:00:29,250\nFine.\n\n"
    )


def test_vtt_has_a_header_and_dot_milliseconds() -> None:
    assert _two_windows().as_vtt() == (
        "WEBVTT\n\n"
        "00:00:00.000 --> 00:00:01.500\nHello there.\n\n"
        "00:00:01.500 --> 00:00:25.000\nHow are you?\n\n"
        "00:00:25.750 --> 00:00:29.250\nFine.\n\n"
    )


def test_clock_carries_into_hours() -> None:
    transcript = Transcript("transcribe", duration_s=3700.0)
    transcript.add_segment(3599.5, _segment(0, 0.0, 1.0, " Late."))
    assert "00:59:59,500 --> 01:00:00,500" in transcript.as_srt()


def test_an_empty_recording_renders_empty() -> None:
    transcript = Transcript("transcribe", duration_s=0.0)
    assert transcript.as_text() == "\n"
    assert transcript.as_srt() == ""
    assert transcript.as_vtt() == "WEBVTT\n\n"
    assert transcript.as_verbose(with_words=False).model_dump(exclude_none=True)["segments"] == []


def test_the_stream_done_event_counts_tokens() -> None:
    transcript = _two_windows()
    transcript.add_usage(3, 20)
    transcript.add_usage(0, 7)
    done = transcript.as_done_event().model_dump(exclude_none=True)
    assert done == {
        "type": "transcript.text.done",
        "text": "Hello there. How are you? Fine.",
        "usage": {"type": "tokens", "input_tokens": 3, "output_tokens": 27, "total_tokens": 30},
    }


@pytest.mark.parametrize(
    "pieces",
    [
        [" Hello there.", " How are you?", " Fine."],  # Whisper's segments, each after a space
        ["Hello", " there. ", " ", "Fine.  "],  # whitespace-only and trailing whitespace wait for more text
        [" ", "  ", " One."],  # nothing before the first word
        ["\n One.\t", "Two.", ""],
        [" ", ""],  # silence: no text at all
        [],
    ],
)
def test_the_deltas_joined_are_the_final_text_byte_for_byte(pieces: list[str]) -> None:
    transcript = Transcript("transcribe", duration_s=10.0)
    deltas = [transcript.add_segment(float(i), _segment(0, 0.0, 1.0, piece)) for i, piece in enumerate(pieces)]
    assert "".join(deltas) == transcript.text == transcript.as_done_event().text == "".join(pieces).strip()
    assert transcript.as_json().model_dump()["text"] == transcript.text
