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
from typing import Any

import anyio
from sse_starlette.sse import AppStatus

from api.render.accumulator import ChoiceDelta, JobResult, OutputItem, collect, follow
from api.render.events import LiveJobEvents
from shared.errors import RelayError

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


class _MessageWriter:
    """The message as its job's result says so far, in Anthropic's shape: choice 0's output
    items are its content blocks, one for one, numbered by position."""

    def __init__(self, stream: LiveJobEvents) -> None:
        job = stream.job
        self._id, self._model = message_id(job.job_id), job.served_name
        # The start event, with the prompt's size, was read before answering.
        self.result = JobResult(prompt_tokens=stream.prompt_tokens)

    def message(self) -> dict[str, Any]:
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [_block(item) for item in self._items],
            **self.stop(),
            "usage": self.usage(),
        }

    def stop(self) -> dict[str, Any]:
        """``stop_reason`` and ``stop_sequence``, as the message and its ``message_delta`` carry them."""
        choice = self.result.choices[0]
        if isinstance(choice.stop_reason, str):
            return {"stop_reason": "stop_sequence", "stop_sequence": choice.stop_reason}
        return {"stop_reason": _STOP_REASONS.get(choice.finish_reason, "end_turn"), "stop_sequence": None}

    def usage(self) -> dict[str, int]:
        return {"input_tokens": self.result.num_prompt_tokens, "output_tokens": self.result.num_completion_tokens}

    @property
    def _items(self) -> list[OutputItem]:
        return self.result.choices[0].items

    def events(self, added: ChoiceDelta) -> list[tuple[str, dict[str, Any]]]:
        """The stream events a delta of choice 0 makes: a block that opens stops the one before
        it, then each update's text arrives as a delta of its block."""
        out: list[tuple[str, dict[str, Any]]] = []
        for update in added.items:
            if update.is_new:
                if update.closed_text is not None:
                    out += self._stop_block(update.position - 1)
                out.append(("content_block_start", {"index": update.position, "content_block": _start(update.item)}))
            if update.text:
                delta = _text_delta(update.item, update.text)
                out.append(("content_block_delta", {"index": update.position, "delta": delta}))
        return out

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """The events that stop the last block, if any."""
        return self._stop_block(len(self._items) - 1) if self._items else []

    def _stop_block(self, index: int) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if self._items[index].kind == "reasoning":
            out.append(("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(("content_block_stop", {"index": index}))
        return out


def _tool_use_id(item: OutputItem) -> str:
    return item.call_id or f"toolu_{item.call_index}"


def _block(item: OutputItem) -> dict[str, Any]:
    if item.kind == "reasoning":
        return {"type": "thinking", "thinking": item.text, "signature": ""}
    if item.kind == "text":
        return {"type": "text", "text": item.text}
    return {"type": "tool_use", "id": _tool_use_id(item), "name": item.name, "input": tool_input(item.text)}


def _start(item: OutputItem) -> dict[str, Any]:
    """A block as it opens, empty; a thinking block's (empty) signature arrives before it stops."""
    if item.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if item.kind == "text":
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": _tool_use_id(item), "name": item.name, "input": {}}


def _text_delta(item: OutputItem, text: str) -> dict[str, Any]:
    if item.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    if item.kind == "text":
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


async def collect_message(stream: LiveJobEvents) -> dict[str, Any]:
    """The non-stream answer; raises RelayError when the job failed."""
    writer = _MessageWriter(stream)
    await collect(stream, writer.result)
    return writer.message()


def _sse(name: str, data: dict[str, Any]) -> dict[str, str]:
    """Every event names itself twice (``event:`` and ``type``): the SDK dispatches on the first."""
    return {"event": name, "data": json.dumps({"type": name, **data}, ensure_ascii=False)}


async def message_events(stream: LiveJobEvents) -> AsyncIterator[dict[str, str]]:
    """The SSE body. A failure becomes an ``error`` event, which the SDK raises; a client that
    disconnects cancels this generator, and the job with it."""
    writer = _MessageWriter(stream)
    start = writer.message()
    start.update(stop_reason=None, usage={"input_tokens": writer.result.num_prompt_tokens, "output_tokens": 0})
    yield _sse("message_start", {"message": start})
    try:
        async for _, added in follow(stream, writer.result):
            if added is not None and added.index == 0:
                for name, data in writer.events(added):
                    yield _sse(name, data)
        for name, data in writer.close():
            yield _sse(name, data)
        yield _sse("message_delta", {"delta": writer.stop(), "usage": writer.usage()})
        yield _sse("message_stop", {})
    except RelayError as exc:
        yield _sse("error", {"error": exc.to_anthropic_body()["error"]})
    finally:
        with anyio.CancelScope(shield=True):
            await stream.close(keep_job=AppStatus.should_exit)
