"""Contract messages → the model's chat template → prompt token ids."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from shared.contract import Generate, Message, ToolCall
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


def to_template_message(message: Message) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant":
        if message.tool_calls:
            rendered["tool_calls"] = [_tool_call_for_template(call) for call in message.tool_calls]
        if message.reasoning_content is not None:
            rendered["reasoning_content"] = message.reasoning_content
    elif message.role == "tool":
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    if system_prompt is None:
        return messages
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{system_prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": system_prompt}, *messages]


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    request: Generate,
    tools: list[dict[str, Any]] | None = None,
    system_prompt: str | None = None,
) -> tuple[list[int], str]:
    """Token ids and text of the prompt; ``tools`` go to the template, ``system_prompt`` is added."""
    if not tokenizer.chat_template:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"model {request.model!r} has no chat template", "messages")
    messages = _with_system_prompt([to_template_message(message) for message in request.messages or []], system_prompt)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            **request.chat_template_kwargs,
        )
    except TemplateError as exc:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"chat template rejected the messages: {exc}", "messages") from exc
    return tokenizer.encode(text, add_special_tokens=False), text
