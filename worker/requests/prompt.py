"""Contract messages → the model's chat template → prompt token ids."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from shared.contract import Generate, ImagePart, Message, ToolCall
from shared.errors import ErrorKind, RelayError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _tool_call_for_template(call: ToolCall) -> dict[str, Any]:
    # Templates such as Qwen3-Coder's iterate `arguments|items`: they need a mapping, not a JSON string.
    try:
        arguments: Any = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = call.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _template_content(message: Message, as_parts: bool) -> str | list[dict[str, Any]]:
    """Text, or (for a vision model's template) parts: one ``{"type": "image"}`` marker per image,
    which the model's processor expands into the image's placeholder tokens."""
    content = message.content
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if as_parts else content
    if not as_parts:
        raise RelayError(ErrorKind.INVALID_REQUEST, "This model does not take image input.", "messages")
    return [{"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
            for part in content]  # fmt: skip


def to_template_message(message: Message, as_parts: bool = False) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": _template_content(message, as_parts)}
    if message.role == "assistant":
        if message.tool_calls:
            rendered["tool_calls"] = [_tool_call_for_template(call) for call in message.tool_calls]
        if message.reasoning_content is not None:
            rendered["reasoning_content"] = message.reasoning_content
    elif message.role == "tool":
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _with_system_prompt(
    messages: list[dict[str, Any]], system_prompt: str | None, as_parts: bool
) -> list[dict[str, Any]]:
    if system_prompt is None:
        return messages
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": f"\n\n{system_prompt}"}]
        else:
            content = f"{content}\n\n{system_prompt}"
        return [{**messages[0], "content": content}, *messages[1:]]
    system: Any = [{"type": "text", "text": system_prompt}] if as_parts else system_prompt
    return [{"role": "system", "content": system}, *messages]


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    request: Generate,
    tools: list[dict[str, Any]] | None = None,
    system_prompt: str | None = None,
) -> tuple[list[int], str]:
    """Token ids and text of the prompt; ``tools`` go to the template, ``system_prompt`` is added."""
    text = render_prompt_text(tokenizer, request, tools, system_prompt)
    return tokenizer.encode(text, add_special_tokens=False), text


def render_prompt_text(
    tokenizer: PreTrainedTokenizerBase,
    request: Generate,
    tools: list[dict[str, Any]] | None = None,
    system_prompt: str | None = None,
    as_parts: bool = False,
) -> str:
    """The chat template's text; ``as_parts``: messages as text and image parts (vision models)."""
    if not tokenizer.chat_template:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"model {request.model!r} has no chat template", "messages")
    rendered = [to_template_message(message, as_parts) for message in request.messages or []]
    messages = _with_system_prompt(rendered, system_prompt, as_parts)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=None if tools is None else [*tools],
            add_generation_prompt=True,
            tokenize=False,
            **request.chat_template_kwargs,
        )
    except TemplateError as exc:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"chat template rejected the messages: {exc}", "messages") from exc
    return str(text)
