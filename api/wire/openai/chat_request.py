"""``POST /v1/chat/completions`` request body, mirroring OpenAI's names and field order.

Fields marked "extension" are not in the OpenAI spec; they follow vLLM's names so clients that
already send them (``top_k``, ``min_p``, ``repetition_penalty``, ``chat_template_kwargs``…) work.
Unknown fields are accepted and ignored, as OpenAI-compatible clients often send extra ones.

A user message may hold images, as ``image_url`` parts (a ``data:`` URL, or an ``http(s)`` one the
server fetches when allowed) or ``file`` parts naming an image uploaded to ``/v1/files``; the API
loads and checks them before the job is queued (``api/images``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.wire.openai.images import ImageLocator, ImageSource
from api.wire.openai.json_schema import JsonSchema
from api.wire.openai.sampling_fields import SamplingFields


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class TextContentPart(_Wire):
    type: Literal["text"]
    text: str


class ImageUrl(_Wire):
    url: str = Field(
        description="A data: URL (base64), or an http(s) URL when the server fetches remote images "
        "(--allow-remote-images)."
    )
    detail: Literal["auto", "low", "high"] = Field(
        default="auto", description="Accepted and not used: the model's own image processor sets the resolution."
    )


class ImageUrlContentPart(_Wire):
    type: Literal["image_url"]
    image_url: ImageUrl

    @property
    def locator(self) -> ImageLocator:
        return ImageLocator(url=self.image_url.url)


class FileReference(_Wire):
    file_id: str = Field(min_length=1, description="An image uploaded to /v1/files (purpose `vision`).")
    filename: str | None = None


class FileContentPart(_Wire):
    """OpenAI's ``file`` part; here it names an uploaded image (``file_data`` is not taken)."""

    type: Literal["file"]
    file: FileReference

    @property
    def locator(self) -> ImageLocator:
        return ImageLocator(file_id=self.file.file_id)


ImageContentPart = ImageUrlContentPart | FileContentPart
ContentPart = Annotated[TextContentPart, Field(discriminator="type")]
UserContentPart = Annotated[TextContentPart | ImageUrlContentPart | FileContentPart, Field(discriminator="type")]
# OpenAI rejects an empty content array ("expected an array with minimum length 1").
MessageContent = str | Annotated[list[ContentPart], Field(min_length=1)]
# Only a user's turn holds images, as in OpenAI's API.
UserMessageContent = str | Annotated[list[UserContentPart], Field(min_length=1)]


class FunctionCall(_Wire):
    name: str
    arguments: str = Field(description="The arguments as a JSON string, as the model produced them.")


class ToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Wire):
    role: Literal["system", "developer"]
    content: MessageContent
    name: str | None = None


class UserMessage(_Wire):
    role: Literal["user"]
    content: UserMessageContent
    name: str | None = None


class AssistantMessage(_Wire):
    role: Literal["assistant"]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = Field(
        default=None, description="Extension: the reasoning of an earlier turn, for templates that render it."
    )

    @model_validator(mode="after")
    def _has_content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        return self


class ToolMessage(_Wire):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(_Wire):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class ToolDefinition(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Wire):
    name: str
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    """The OpenAI chat request."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(
        default=None, ge=1, description="Deprecated by OpenAI in favour of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extension: extra variables for the chat template, e.g. enable_thinking."
    )
    background: bool = Field(
        default=False,
        description="Extension (OpenAI's background mode): answer at once with an id; poll "
        "GET /v1/chat/completions/{id} for the result.",
    )

    @model_validator(mode="after")
    def _logprob_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.background and self.stream:
            raise ValueError("background=true cannot be combined with stream=true; poll the job by id instead")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``, as in OpenAI's API."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_new_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def logprob_count(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the k most likely."""
        return (self.top_logprobs or 0) if self.logprobs else None


def image_sources(request: ChatCompletionRequest) -> list[ImageSource]:
    """The request's image parts in order, each named as OpenAI names a field
    (``messages[0].content[1].image_url``)."""
    return [
        ImageSource(f"messages[{i}].content[{j}].{part.type}", part.locator)
        for i, message in enumerate(request.messages)
        if isinstance(message, UserMessage) and not isinstance(message.content, str)
        for j, part in enumerate(message.content)
        if isinstance(part, ImageUrlContentPart | FileContentPart)
    ]
