"""A chat job's events as the Responses API answers: a ``response`` object whose ``output`` holds
``reasoning``, ``message`` and ``function_call`` items, or its SSE event sequence (each event with
its ``sequence_number``: created, in_progress, per item added → parts and deltas → done, then one
terminal event).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from api.render.accumulator import ChoiceDelta, JobResult, OutputItem, collect, follow
from api.render.events import JobEvents
from api.wire.responses import ResponsesRequest
from shared.errors import RelayError


def response_id(job_id: str) -> str:
    return f"resp_{job_id}"


_ITEM_ID_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class ResponseBuilder:
    """The response as its job's result says so far; ``events`` renders what each delta adds,
    ``response`` the Response object. Items are choice 0's output items, one for one."""

    request: ResponsesRequest
    job_id: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    input_tokens: int = 0  # the prompt's size, when its start event was read before the builder was made
    result: JobResult = field(init=False)

    def __post_init__(self) -> None:
        self.result = JobResult(prompt_tokens=self.input_tokens)

    @property
    def id(self) -> str:
        return response_id(self.job_id)

    @property
    def _items(self) -> list[OutputItem]:
        return self.result.choices[0].items

    def events(self, added: ChoiceDelta) -> list[dict[str, Any]]:
        """The stream events a delta of choice 0 makes: an item that opens finishes the one
        before it, then each update's text arrives as a delta of its item."""
        out: list[dict[str, Any]] = []
        for update in added.items:
            if update.is_new:
                if update.closed_text is not None:
                    out += self._done(update.position - 1, update.closed_text)
                out += self._added(update.position, update.item)
            if update.text:
                out.append(self._delta(update.position, update.item, update.text))
        return out

    def close(self) -> list[dict[str, Any]]:
        """The events that finish the last item, if any."""
        return self._done(len(self._items) - 1, self._items[-1].text) if self._items else []

    def _item_id(self, position: int) -> str:
        return f"{_ITEM_ID_PREFIXES[self._items[position].kind]}_{self.job_id}_{position}"

    def _item(self, position: int, status: str, text: str | None = None) -> dict[str, Any]:
        """The item at ``position``; completed, with ``text`` (default: all of it so far)."""
        item, item_id = self._items[position], self._item_id(position)
        text = item.text if text is None else text
        if item.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
            return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
        if item.kind == "text":
            parts = [_text_part(text)] if status == "completed" else []
            return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": parts}
        arguments = text if status == "completed" else ""
        return {
            "type": "function_call", "id": item_id, "call_id": item.call_id, "name": item.name,
            "arguments": arguments, "status": status,
        }  # fmt: skip

    def _part_where(self, position: int) -> dict[str, Any]:
        return {"item_id": self._item_id(position), "output_index": position, "content_index": 0}

    def _added(self, position: int, item: OutputItem) -> list[dict[str, Any]]:
        out = [
            {
                "type": "response.output_item.added",
                "output_index": position,
                "item": self._item(position, "in_progress"),
            }
        ]
        if item.kind != "tool_call":
            part = {"type": "reasoning_text", "text": ""} if item.kind == "reasoning" else _text_part("")
            out.append({"type": "response.content_part.added", **self._part_where(position), "part": part})
        return out

    def _delta(self, position: int, item: OutputItem, text: str) -> dict[str, Any]:
        if item.kind == "tool_call":
            return {
                "type": "response.function_call_arguments.delta", "item_id": self._item_id(position),
                "output_index": position, "delta": text,
            }  # fmt: skip
        if item.kind == "reasoning":
            return {"type": "response.reasoning_text.delta", **self._part_where(position), "delta": text}
        return {"type": "response.output_text.delta", **self._part_where(position), "delta": text, "logprobs": []}

    def _done(self, position: int, text: str) -> list[dict[str, Any]]:
        """The events that end the item at ``position``, whose text is ``text`` as it ends."""
        item = self._items[position]
        out: list[dict[str, Any]] = []
        if item.kind == "reasoning":
            out.append({"type": "response.reasoning_text.done", **self._part_where(position), "text": text})
            out.append({"type": "response.content_part.done", **self._part_where(position),
                        "part": {"type": "reasoning_text", "text": text}})  # fmt: skip
        elif item.kind == "text":
            out.append(
                {"type": "response.output_text.done", **self._part_where(position), "text": text, "logprobs": []}
            )
            out.append({"type": "response.content_part.done", **self._part_where(position), "part": _text_part(text)})
        else:
            out.append({"type": "response.function_call_arguments.done", "item_id": self._item_id(position),
                        "output_index": position, "name": item.name, "arguments": text})  # fmt: skip
        out.append(
            {
                "type": "response.output_item.done",
                "output_index": position,
                "item": self._item(position, "completed", text),
            }
        )
        return out

    def response(self, status: str, error: RelayError | None = None) -> dict[str, Any]:
        """The Response object; ``status``: queued, in_progress, completed, incomplete or failed."""
        request = self.request
        is_final = status in ("completed", "incomplete", "failed", "cancelled")
        text_format = request.text.format.model_dump(by_alias=True, exclude_none=True) if (
            request.text is not None and request.text.format is not None
        ) else {"type": "text"}  # fmt: skip
        tool_choice = request.tool_choice if isinstance(request.tool_choice, str) else request.tool_choice.model_dump()
        usage = None
        if is_final and status != "failed":
            result = self.result
            num_input, num_output = result.num_prompt_tokens, result.num_completion_tokens
            usage = {
                "input_tokens": num_input, "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
                "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": num_input + num_output,
            }  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": request.background, "model": request.model,
            "output": self.output_items() if is_final else [],
            "error": {"code": error.spec.code or error.kind.value, "message": error.message} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
            "store": request.store, "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": text_format}, "tool_choice": tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "truncation": "disabled", "usage": usage, "user": request.user,
        }  # fmt: skip

    @property
    def final_status(self) -> str:
        return "incomplete" if self.result.choices[0].finish_reason == "length" else "completed"

    def output_items(self) -> list[dict[str, Any]]:
        return [self._item(position, "completed") for position in range(len(self._items))]


async def collect_response(stream: JobEvents, builder: ResponseBuilder) -> dict[str, Any]:
    """The non-stream answer; raises RelayError when the job failed before any output."""
    await collect(stream, builder.result)
    return builder.response(builder.final_status)


async def response_events(
    stream: JobEvents, builder: ResponseBuilder, on_end: Callable[[dict[str, Any]], Any], with_ids: bool = False
) -> AsyncIterator[dict[str, str]]:
    """The SSE body; ``on_end`` gets the final Response (to store it) before the terminal event.
    ``with_ids``: each SSE event's ``id`` is its sequence number (a replay filters on it)."""
    sequence = 0

    def sse(event: dict[str, Any]) -> dict[str, str]:
        nonlocal sequence
        data = {**event, "sequence_number": sequence}
        sequence += 1
        out = {"event": event["type"], "data": json.dumps(data, ensure_ascii=False)}
        if with_ids:
            out["id"] = str(data["sequence_number"])
        return out

    yield sse({"type": "response.created", "response": builder.response("in_progress")})
    yield sse({"type": "response.in_progress", "response": builder.response("in_progress")})
    try:
        async for _, added in follow(stream, builder.result):
            if added is not None and added.index == 0:
                for out in builder.events(added):
                    yield sse(out)
        for out in builder.close():
            yield sse(out)
        final = builder.response(builder.final_status)
        await on_end(final)
        yield sse({"type": f"response.{final['status']}", "response": final})
    except RelayError as exc:
        yield sse(
            {"type": "error", "code": exc.spec.code or exc.kind.value, "message": exc.message, "param": exc.param}
        )
        yield sse({"type": "response.failed", "response": builder.response("failed", exc)})
    finally:
        await stream.close()
