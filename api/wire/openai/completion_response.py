"""Text completion responses (``object: "text_completion"``), whole and as stream chunks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.wire.openai.chat_response import FinishReason, Usage


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = Field(
        default=None, description="Extension (vLLM): the stop string or stop token id that ended the choice."
    )


class Completion(BaseModel):
    """Both the non-stream response and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
