"""A job's event stream, from the worker to the API: a tagged union with per-job sequence numbers.

Every event carries ``seq`` (0, 1, 2, … per job) so the API can detect a duplicate or a gap.
A job's stream is ``start``, then ``delta``s (one per choice and step; a choice's last delta
carries its ``finish_reason``), then exactly one ``end`` — or an ``error`` at any point, which
also ends the stream. Events travel as msgpack maps, never pickle.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgpack
from pydantic import BaseModel, Field, TypeAdapter

from shared.errors import ErrorKind, RelayError


class StartEvent(BaseModel):
    type: Literal["start"] = "start"
    seq: int
    worker_id: str
    prompt_tokens: int


class ToolCallDelta(BaseModel):
    """One fragment of a streamed tool call, by OpenAI's rules: the first fragment of a call
    carries ``id`` and ``name`` (and ``arguments: ""``); later ones only argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float


class TokenLogprob(BaseModel):
    """A generated token's log-probability under the model (before sampling adjustments)."""

    token: str
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class DeltaEvent(BaseModel):
    type: Literal["delta"] = "delta"
    seq: int
    index: int = 0
    token_ids: list[int] = Field(default_factory=list, description="Tokens generated since the choice's last delta.")
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: str | int | None = Field(
        default=None, description="With finish_reason stop: the request's stop string or stop token id that matched."
    )


class EmbeddingsEvent(BaseModel):
    """All of a job's embeddings, in input order (one event: nothing to stream)."""

    type: Literal["embeddings"] = "embeddings"
    seq: int
    vectors: list[list[float]]


class WordTiming(BaseModel):
    word: str
    start: float
    end: float
    probability: float


class SegmentEvent(BaseModel):
    """One transcribed segment of a transcription window, times relative to the window's start.
    ``index`` counts the window's segments from 0: a worker that continues a window after
    another died re-transcribes it and sends only the segments the log lacks."""

    type: Literal["segment"] = "segment"
    seq: int
    index: int
    start: float
    end: float
    text: str
    tokens: list[int] = Field(default_factory=list)
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    temperature: float = 0.0
    words: list[WordTiming] | None = None


class TranscriptEvent(BaseModel):
    """A transcription window's summary, after its last segment and before its end event."""

    type: Literal["transcript"] = "transcript"
    seq: int
    language: str
    language_probability: float = 1.0
    duration_s: float
    num_segments: int


class UsageCounts(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class EndEvent(BaseModel):
    type: Literal["end"] = "end"
    seq: int
    usage: UsageCounts


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    seq: int
    kind: ErrorKind
    message: str
    param: str | None = None

    def to_exception(self) -> RelayError:
        return RelayError(self.kind, self.message, self.param)


AnyEvent = StartEvent | DeltaEvent | EmbeddingsEvent | SegmentEvent | TranscriptEvent | EndEvent | ErrorEvent
JobEvent = Annotated[AnyEvent, Field(discriminator="type")]
_job_event_adapter: TypeAdapter[JobEvent] = TypeAdapter(JobEvent)


def encode_event(event: AnyEvent) -> bytes:
    return msgpack.packb(event.model_dump(mode="json", exclude_none=True))


def decode_event(payload: bytes) -> AnyEvent:
    return event_from_json(msgpack.unpackb(payload, raw=False))


def event_from_json(data: object) -> AnyEvent:
    """An event from its JSON form (``model_dump(mode="json")``)."""
    return _job_event_adapter.validate_python(data)
