"""The OpenAI Responses API request (``POST /v1/responses``), and its translation into the chat
request every worker already runs: like the Messages API, a wire format on the same jobs.

Input items: messages (text parts, and in a user's message ``input_image`` parts: an image URL or
an uploaded file's id), ``function_call`` (an earlier call of the model), ``function_call_output``
(its result) and ``reasoning`` (earlier reasoning text). Hosted tools and other files are refused
with a 400 naming them: relaylm runs local models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from api.wire.openai import chat_request as chat
from api.wire.openai.images import ImageLocator, ImageSource
from api.wire.openai.json_schema import JsonSchema
from shared.fair_share import PRIORITY_MAX, PRIORITY_MIN


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputText(_Wire):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(_Wire):
    type: Literal["input_image"]
    image_url: str | None = Field(
        default=None, description="A data: URL, or an http(s) URL when the server fetches remote images."
    )
    file_id: str | None = Field(default=None, description="An image uploaded to /v1/files (purpose `vision`).")
    detail: Literal["auto", "low", "high"] = Field(
        default="auto", description="Accepted and not used: the model's own image processor sets the resolution."
    )

    @model_validator(mode="after")
    def _one_source(self) -> InputImage:
        if (self.image_url is None) == (self.file_id is None):
            raise ValueError("an input_image needs one of `image_url` and `file_id`")
        return self

    @property
    def locator(self) -> ImageLocator:
        return ImageLocator(url=self.image_url, file_id=self.file_id)

    def chat_part(self) -> chat.UserContentPart:
        if self.file_id is not None:
            return chat.FileContentPart(type="file", file=chat.FileReference(file_id=self.file_id))
        return chat.ImageUrlContentPart(
            type="image_url", image_url=chat.ImageUrl(url=self.image_url or "", detail=self.detail)
        )


InputContent = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Wire):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[InputContent], Field(min_length=1)]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, InputText))

    @property
    def images(self) -> list[tuple[int, InputImage]]:
        """The image parts, by position in ``content``."""
        if isinstance(self.content, str):
            return []
        return [(i, part) for i, part in enumerate(self.content) if isinstance(part, InputImage)]


class FunctionCallItem(_Wire):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Wire):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(_Wire):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Wire):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


def _item_kind(value: Any) -> str:
    """An item's ``type``; a message may leave it out (the SDK's "easy" input message)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return str(kind)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Wire):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Wire):
    type: Literal["function"]
    name: str


class TextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Wire):
    format: TextFormat | None = None


class ReasoningConfig(_Wire):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Wire):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    priority: int = Field(
        default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="Extension (vLLM's): lower is sooner; see chat."
    )

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


def to_chat_request(request: ResponsesRequest, history: list[InputItem]) -> chat.ChatCompletionRequest:
    """The conversation (``history``: a stored earlier turn's input and output items, for
    ``previous_response_id``; then this request's input) as an OpenAI chat request."""
    messages: list[chat.ChatMessage] = []
    if request.instructions:
        messages.append(chat.SystemMessage(role="system", content=request.instructions))
    messages += chat_messages([*history, *request.input_items()])
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
        "stream": request.stream,
        "priority": request.priority,
    }
    if request.stream:
        fields["stream_options"] = {"include_usage": True}
    if request.max_output_tokens is not None:
        fields["max_completion_tokens"] = request.max_output_tokens
    if request.user:
        fields["user"] = request.user
    if request.prompt_cache_key:
        fields["prompt_cache_key"] = request.prompt_cache_key
    if request.tools:
        fields["tools"] = [
            chat.ToolDefinition(
                function=chat.FunctionDefinition(
                    name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
                )
            )
            for tool in request.tools
        ]
        choice = request.tool_choice
        fields["tool_choice"] = (
            chat.NamedToolChoice(function=chat.NamedFunction(name=choice.name))
            if isinstance(choice, NamedFunctionChoice)
            else choice
        )
    elif request.tool_choice == "required" or isinstance(request.tool_choice, NamedFunctionChoice):
        raise ValueError("tool_choice needs tools")
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type != "text":
        schema = None
        if text_format.type == "json_schema":
            schema = chat.JsonSchemaFormat(
                name=text_format.name or "output", schema=text_format.schema_, strict=text_format.strict
            )
        fields["response_format"] = chat.ResponseFormat(type=text_format.type, json_schema=schema)
    if request.reasoning is not None and request.reasoning.effort is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": request.reasoning.effort not in ("none", "minimal")}
    return chat.ChatCompletionRequest.model_validate(fields)


def chat_messages(items: list[InputItem]) -> list[chat.ChatMessage]:
    """Items in order; consecutive function calls (with the reasoning and text before them) form
    one assistant turn, as chat templates expect."""
    messages: list[chat.ChatMessage] = []
    pending_reasoning = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            pending_reasoning += item.text
        elif isinstance(item, FunctionCallItem):
            call = chat.ToolCall(id=item.call_id, function=chat.FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if isinstance(last, chat.AssistantMessage) and not pending_reasoning:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(
                    chat.AssistantMessage(
                        role="assistant", tool_calls=[call], reasoning_content=pending_reasoning or None
                    )
                )
                pending_reasoning = ""
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(chat.ToolMessage(role="tool", tool_call_id=item.call_id, content=item.text))
        elif item.role == "assistant":
            messages.append(
                chat.AssistantMessage(role="assistant", content=item.text, reasoning_content=pending_reasoning or None)
            )
            pending_reasoning = ""
        elif item.images and item.role != "user":
            raise ValueError(f"input_image parts are taken in user messages, not in a {item.role} message")
        elif item.role in ("system", "developer"):
            messages.append(chat.SystemMessage(role=item.role, content=item.text))
        else:
            messages.append(chat.UserMessage(role="user", content=_user_content(item)))
    return messages


def _user_content(item: MessageItem) -> str | list[chat.UserContentPart]:
    """Text alone is one string, as before images; with images, the parts in order."""
    if isinstance(item.content, str) or not item.images:
        return item.text
    return [
        part.chat_part() if isinstance(part, InputImage) else chat.TextContentPart(type="text", text=part.text)
        for part in item.content
    ]


def image_sources(request: ResponsesRequest, history: list[InputItem]) -> list[ImageSource]:
    """The conversation's image parts in order, named as the Responses API names a field
    (``input[0].content[1]``); an earlier turn's, loaded again, by ``previous_response_id``."""
    earlier = [
        ImageSource("previous_response_id", image.locator)
        for item in history
        if isinstance(item, MessageItem)
        for _, image in item.images
    ]
    return earlier + [
        ImageSource(f"input[{i}].content[{j}]", image.locator)
        for i, item in enumerate(request.input_items())
        if isinstance(item, MessageItem)
        for j, image in item.images
    ]
