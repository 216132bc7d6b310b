"""OpenAI's audio transcription and translation responses, field for field (the ``openai`` SDK's
``types/audio``), for Whisper models: usage in seconds, no log probabilities."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

AudioResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
RESPONSE_FORMATS: tuple[str, ...] = ("json", "text", "srt", "verbose_json", "vtt")
STREAM_FORMATS: tuple[str, ...] = ("json", "text")
TIMESTAMP_GRANULARITIES: tuple[str, ...] = ("word", "segment")


class UsageDuration(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: float = Field(description="The audio's length in seconds.")


class UsageTokens(BaseModel):
    """A streamed transcription's usage (``transcript.text.done`` counts tokens)."""

    type: Literal["tokens"] = "tokens"
    input_tokens: int = Field(description="Prompt tokens (the `prompt` field's), summed over the windows.")
    output_tokens: int
    total_tokens: int


class TranscriptionSegment(BaseModel):
    id: int = Field(description="The segment's number in the whole recording, from 0.")
    seek: int = Field(description="Where the segment's window starts, in 10 ms frames (as Whisper counts).")
    start: float = Field(description="Seconds from the start of the recording.")
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionWord(BaseModel):
    word: str
    start: float
    end: float


class Transcription(BaseModel):
    text: str
    usage: UsageDuration | None = None


class TranscriptionVerbose(BaseModel):
    task: Literal["transcribe"] = Field(default="transcribe", description="As whisper-1 answers; not in the SDK.")
    language: str = Field(description="The spoken language's English name, lower case (`english`).")
    duration: float
    text: str
    segments: list[TranscriptionSegment] | None = None
    words: list[TranscriptionWord] | None = None
    usage: UsageDuration | None = None


class Translation(BaseModel):
    text: str


class TranslationVerbose(BaseModel):
    task: Literal["translate"] = Field(default="translate", description="As whisper-1 answers; not in the SDK.")
    language: str = Field(default="english", description="The output's language: always `english`.")
    duration: float
    text: str
    segments: list[TranscriptionSegment] | None = None


class TranscriptionTextDeltaEvent(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptionTextDoneEvent(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: UsageTokens | None = None
