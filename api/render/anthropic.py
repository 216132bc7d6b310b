"""A chat job's events as the Anthropic Messages API answers: a ``message`` object, or its SSE
event sequence (``message_start``, content blocks, ``message_delta``, ``message_stop``).

Blocks are numbered in the order they open, as the SDK indexes the final ``content`` by them:
reasoning becomes a ``thinking`` block (with an empty ``signature``: a local server cannot sign),
text a ``text`` block, each tool call a ``tool_use`` block whose input streams as JSON fragments.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from sse_starlette.sse import AppStatus

from api.jobs.stream import JobStream
from shared.errors import RelayError
from shared.events import DeltaEvent, EndEvent, ErrorEvent, StartEvent

logger = logging.getLogger(__name__)

# finish_reason → stop_reason; a "stop" that one of stop_sequences made is "stop_sequence".
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", None: "end_turn"}


def message_id(job_id: str) -> str:
    """``msg_…``, as Anthropic's ids look; the job id follows, so a log line finds the job."""
    return f"msg_{job_id}"


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's input is an object on this API; text that is not one is kept under a key."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    logger.info("tool call arguments are not a JSON object; sent as {'raw_arguments': ...}")
    return {"raw_arguments": arguments}


@dataclass
class _Block:
    kind: str  # "thinking", "text" or "tool_use"
    text: str = ""
    tool_id: str = ""
    name: str = ""


@dataclass
class _Message:
    """What the events say so far: the blocks in order, the stop reason and usage."""

    blocks: list[_Block] = field(default_factory=list)
    tool_blocks: dict[int, int] = field(default_factory=dict)  # tool call index → block index
    finish_reason: str | None = None
    stop_sequence: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0

    def stop(self) -> dict[str, Any]:
        """``stop_reason`` and ``stop_sequence``, as the message and its ``message_delta`` carry them."""
        if self.stop_sequence is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": self.stop_sequence}
        return {"stop_reason": _STOP_REASONS.get(self.finish_reason, "end_turn"), "stop_sequence": None}


def _message_object(job: Any, message: _Message) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for block in message.blocks:
        if block.kind == "thinking":
            content.append({"type": "thinking", "thinking": block.text, "signature": ""})
        elif block.kind == "text":
            content.append({"type": "text", "text": block.text})
        else:
            content.append(
                {"type": "tool_use", "id": block.tool_id, "name": block.name, "input": tool_input(block.text)}
            )
    return {
        "id": message_id(job.job_id),
        "type": "message",
        "role": "assistant",
        "model": job.request.model,
        "content": content,
        **message.stop(),
        "usage": {"input_tokens": message.input_tokens, "output_tokens": message.output_tokens},
    }


async def collect_message(stream: JobStream) -> dict[str, Any]:
    """The non-stream answer; raises RelayError when the job failed. (The start event, with the
    prompt's size, was read before answering: ``stream.prompt_tokens``.)"""
    message = _Message(input_tokens=stream.prompt_tokens or 0)
    try:
        async for event in stream.events():
            if isinstance(event, ErrorEvent):
                raise event.to_exception()
            _apply(message, event)
    finally:
        await stream.close()
    return _message_object(stream.job, message)


def _apply(message: _Message, event: object) -> list[tuple[str, dict[str, Any]]]:
    """Fold one event into ``message``; returns the stream events it makes, in order."""
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(event, StartEvent):
        message.input_tokens = event.prompt_tokens
    elif isinstance(event, EndEvent):
        message.input_tokens = event.usage.prompt_tokens
        message.output_tokens = event.usage.completion_tokens
    elif isinstance(event, DeltaEvent) and event.index == 0:
        if event.reasoning:
            out += _extend(message, "thinking", event.reasoning, "thinking_delta", "thinking")
        if event.content:
            out += _extend(message, "text", event.content, "text_delta", "text")
        for call in event.tool_calls or []:
            if call.id is not None or call.index not in message.tool_blocks:
                out += _close_last(message)
                message.blocks.append(
                    _Block("tool_use", tool_id=call.id or f"toolu_{call.index}", name=call.name or "")
                )
                index = message.tool_blocks[call.index] = len(message.blocks) - 1
                start = {"type": "tool_use", "id": message.blocks[index].tool_id, "name": message.blocks[index].name}
                out.append(("content_block_start", {"index": index, "content_block": {**start, "input": {}}}))
            index = message.tool_blocks[call.index]
            if call.arguments:
                message.blocks[index].text += call.arguments
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                out.append(("content_block_delta", {"index": index, "delta": delta}))
        if event.finish_reason is not None:
            message.finish_reason = event.finish_reason
        if isinstance(event.stop_reason, str):
            message.stop_sequence = event.stop_reason
    return out


def _extend(message: _Message, kind: str, text: str, delta_type: str, field_name: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if not message.blocks or message.blocks[-1].kind != kind:
        out += _close_last(message)
        message.blocks.append(_Block(kind))
        start: dict[str, Any] = {"type": kind, field_name: ""}
        if kind == "thinking":
            start["signature"] = ""
        out.append(("content_block_start", {"index": len(message.blocks) - 1, "content_block": start}))
    message.blocks[-1].text += text
    out.append(
        ("content_block_delta", {"index": len(message.blocks) - 1, "delta": {"type": delta_type, field_name: text}})
    )
    return out


def _close_last(message: _Message) -> list[tuple[str, Any]]:
    if not message.blocks:
        return []
    index = len(message.blocks) - 1
    out: list[tuple[str, Any]] = []
    if message.blocks[index].kind == "thinking":
        out.append(("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}}))
    out.append(("content_block_stop", {"index": index}))
    return out


def _sse(name: str, data: dict[str, Any]) -> dict[str, str]:
    """Every event names itself twice (``event:`` and ``type``): the SDK dispatches on the first."""
    return {"event": name, "data": json.dumps({"type": name, **data}, ensure_ascii=False)}


async def message_events(stream: JobStream) -> AsyncIterator[dict[str, str]]:
    """The SSE body. A failure becomes an ``error`` event, which the SDK raises; a client that
    disconnects cancels this generator, and the job with it."""
    message = _Message(input_tokens=stream.prompt_tokens or 0)
    start = _message_object(stream.job, message)
    start.update(stop_reason=None, usage={"input_tokens": message.input_tokens, "output_tokens": 0})
    yield _sse("message_start", {"message": start})
    try:
        async for event in stream.events():
            if isinstance(event, ErrorEvent):
                yield _sse("error", {"error": event.to_exception().to_anthropic_body()["error"]})
                return
            for name, data in _apply(message, event):
                yield _sse(name, data)
        for name, data in _close_last(message):
            yield _sse(name, data)
        stop = message.stop()
        usage = {"input_tokens": message.input_tokens, "output_tokens": message.output_tokens}
        yield _sse("message_delta", {"delta": stop, "usage": usage})
        yield _sse("message_stop", {})
    except RelayError as exc:
        yield _sse("error", {"error": exc.to_anthropic_body()["error"]})
    finally:
        with anyio.CancelScope(shield=True):
            await stream.close(keep_job=AppStatus.should_exit)
