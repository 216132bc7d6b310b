"""The Anthropic Messages API request (``POST /v1/messages``), and its translation into the chat
request every worker already runs: the Messages API is a second wire format on the same jobs,
queue, engine, tool parsing and constrained decoding, not a second path.

Field names follow the ``anthropic`` SDK's types. Image blocks in a user turn (base64, a URL or
an uploaded file) become the chat request's image parts, for a model that takes images; blocks
that need what a local model does not have (documents) are refused with a 400 naming them;
thinking blocks sent back are passed to the chat template as the turn's reasoning.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.wire.openai import chat_request as chat
from api.wire.openai.images import ImageLocator, ImageSource
from api.wire.openai.json_schema import JsonSchema


class _Wire(BaseModel):
    # Unknown fields (cache_control, citations, service_tier, …) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Wire):
    """Anthropic's encrypted reasoning: a local model cannot read it, so it is dropped."""

    type: Literal["redacted_thinking"]
    data: str = ""


class Base64ImageSource(_Wire):
    type: Literal["base64"]
    media_type: str = Field(description="As the client says; what the image is, decoding decides.")
    data: str


class UrlImageSource(_Wire):
    type: Literal["url"]
    url: str


class FileImageSource(_Wire):
    type: Literal["file"]
    file_id: str = Field(min_length=1, description="An image uploaded to /v1/files.")


class ImageBlock(_Wire):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | UrlImageSource | FileImageSource, Field(discriminator="type")]

    @property
    def locator(self) -> ImageLocator:
        source = self.source
        if isinstance(source, FileImageSource):
            return ImageLocator(file_id=source.file_id)
        if isinstance(source, UrlImageSource):
            return ImageLocator(url=source.url)
        return ImageLocator(url=f"data:{source.media_type};base64,{source.data}")

    def chat_part(self) -> chat.UserContentPart:
        locator = self.locator
        if locator.file_id is not None:
            return chat.FileContentPart(type="file", file=chat.FileReference(file_id=locator.file_id))
        return chat.ImageUrlContentPart(type="image_url", image_url=chat.ImageUrl(url=locator.url or ""))


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(_Wire):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]


class ToolSpec(_Wire):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: JsonSchema


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class Metadata(_Wire):
    user_id: str | None = None


class CountTokensRequest(_Wire):
    """``POST /v1/messages/count_tokens``: what the prompt of a Messages request would be."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None


def to_chat_request(request: CountTokensRequest) -> chat.ChatCompletionRequest:
    """The same conversation as an OpenAI chat request (raises ValueError naming what cannot be
    expressed; pydantic then reports the chat request's own rules)."""
    fields: dict[str, Any] = {"model": request.model, "messages": _chat_messages(request)}
    if request.tools:
        fields["tools"] = [
            chat.ToolDefinition(
                function=chat.FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema)
            )
            for t in request.tools
        ]
    if request.tool_choice is not None:
        fields.update(_tool_choice(request.tool_choice, bool(request.tools)))
    if request.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": request.thinking.type != "disabled"}
    if isinstance(request, MessagesRequest):
        fields.update(max_tokens=request.max_tokens, stream=request.stream, temperature=request.temperature)
        fields.update(top_p=request.top_p, top_k=request.top_k if request.top_k is not None else -1)
        if request.stop_sequences:
            fields["stop"] = request.stop_sequences
        if request.metadata is not None and request.metadata.user_id:
            fields["user"] = request.metadata.user_id
        if request.stream:
            fields["stream_options"] = {"include_usage": True}
    return chat.ChatCompletionRequest.model_validate(fields)


def _tool_choice(choice: ToolChoice, has_tools: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if not choice.name:
            raise ValueError("tool_choice of type `tool` needs the tool's `name`")
        fields["tool_choice"] = chat.NamedToolChoice(function=chat.NamedFunction(name=choice.name))
    elif choice.type == "any":
        fields["tool_choice"] = "required"
    elif has_tools or choice.type == "none":
        fields["tool_choice"] = choice.type
    return fields


def _chat_messages(request: CountTokensRequest) -> list[chat.ChatMessage]:
    messages: list[chat.ChatMessage] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else "".join(b.text for b in request.system)
        messages.append(chat.SystemMessage(role="system", content=system))
    for message in request.messages:
        blocks: list[Any] = (
            [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        )
        if message.role == "assistant":
            messages.append(_assistant_message(blocks))
        else:
            messages.extend(_user_messages(blocks))
    return messages


def _assistant_message(blocks: list[Any]) -> chat.AssistantMessage:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    calls = [
        chat.ToolCall(
            id=b.id, function=chat.FunctionCall(name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))
        )
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    if any(isinstance(b, ToolResultBlock | ImageBlock) for b in blocks):
        raise ValueError("tool_result and image blocks belong in a user turn")
    return chat.AssistantMessage(
        role="assistant", content=text if text or not calls else None, tool_calls=calls or None,
        reasoning_content=thinking or None,
    )  # fmt: skip


def _user_messages(blocks: list[Any]) -> list[chat.ChatMessage]:
    """Tool results become tool messages (in their order, before the turn's text), as chat
    templates expect them right after the assistant's calls."""
    if any(isinstance(b, ToolUseBlock | ThinkingBlock) for b in blocks):
        raise ValueError("tool_use and thinking blocks belong in an assistant turn")
    messages: list[chat.ChatMessage] = [
        chat.ToolMessage(role="tool", tool_call_id=b.tool_use_id, content=_tool_result_text(b))
        for b in blocks
        if isinstance(b, ToolResultBlock)
    ]
    if any(isinstance(b, ImageBlock) for b in blocks):
        parts = [_chat_part(b) for b in blocks if isinstance(b, TextBlock | ImageBlock)]
        return [*messages, chat.UserMessage(role="user", content=parts)]
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if text or not messages:
        messages.append(chat.UserMessage(role="user", content=text))
    return messages


def _chat_part(block: TextBlock | ImageBlock) -> chat.UserContentPart:
    return block.chat_part() if isinstance(block, ImageBlock) else chat.TextContentPart(type="text", text=block.text)


def image_sources(request: CountTokensRequest) -> list[ImageSource]:
    """The user turns' image blocks in order, named by their ``source`` (``messages[0].content[1].source``)."""
    return [
        ImageSource(f"messages[{i}].content[{j}].source", block.locator)
        for i, message in enumerate(request.messages)
        if message.role == "user" and not isinstance(message.content, str)
        for j, block in enumerate(message.content)
        if isinstance(block, ImageBlock)
    ]


def _tool_result_text(block: ToolResultBlock) -> str:
    return f"Error: {block.text}" if block.is_error else block.text


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The error body on the Messages API's routes (for the OpenAPI schema)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorObject
