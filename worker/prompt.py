"""OpenAI messages → the model's chat template → prompt token ids."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from shared.errors import ErrorKind, RelayError
from shared.openai.chat_request import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    MessageContent,
    SystemMessage,
    ToolMessage,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _text(content: MessageContent | None) -> str:
    """Text parts are joined with newlines, as vLLM does for text-only templates."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _tool_call_for_template(call: Any) -> dict[str, Any]:
    # Templates such as Qwen3-Coder's iterate `arguments|items`: they need a mapping, not a JSON string.
    try:
        arguments: Any = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def to_template_message(message: ChatMessage) -> dict[str, Any]:
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": _text(message.content)}
    if isinstance(message, AssistantMessage):
        rendered: dict[str, Any] = {"role": "assistant", "content": _text(message.content)}
        if message.tool_calls:
            rendered["tool_calls"] = [_tool_call_for_template(call) for call in message.tool_calls]
        if message.reasoning_content is not None:
            rendered["reasoning_content"] = message.reasoning_content
        return rendered
    if isinstance(message, ToolMessage):
        return {"role": "tool", "content": _text(message.content), "tool_call_id": message.tool_call_id}
    return {"role": message.role, "content": _text(message.content)}


def _with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    if system_prompt is None:
        return messages
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{system_prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": system_prompt}, *messages]


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    request: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None = None,
    system_prompt: str | None = None,
) -> tuple[list[int], str]:
    """Token ids and text of the prompt; ``tools`` go to the template, ``system_prompt`` is added."""
    if not tokenizer.chat_template:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"model {request.model!r} has no chat template", "messages")
    messages = _with_system_prompt([to_template_message(message) for message in request.messages], system_prompt)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            **(request.chat_template_kwargs or {}),
        )
    except TemplateError as exc:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"chat template rejected the messages: {exc}", "messages") from exc
    return tokenizer.encode(text, add_special_tokens=False), text
