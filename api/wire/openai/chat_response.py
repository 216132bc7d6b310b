"""Chat completion responses, non-stream and stream chunks, in OpenAI's exact shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = Field(default=None, description="Extension: the model's reasoning text.")
    reasoning: str | None = Field(default=None, description="Extension: the same, under vLLM's newer name.")

    @model_serializer(mode="wrap")
    def _drop_unset_extensions(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("tool_calls", "reasoning_content", "reasoning"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobEntry] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[LogprobEntry] | None = None


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = Field(
        default=None, description="Extension (vLLM): the stop string or stop token id that ended the choice."
    )


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    # Optional as in OpenAI's own schema: a background job's first answer has no usage yet.
    usage: Usage | None = None
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """Only the fields a chunk sets are sent: ``{"content": "Hel"}``, ``{"role": "assistant", ...}``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, description="Extension: reasoning text delta.")
    reasoning: str | None = Field(default=None, description="Extension: the same, under vLLM's newer name.")
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = Field(
        default=None, description="Extension (vLLM): the stop string or stop token id that ended the choice."
    )


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
