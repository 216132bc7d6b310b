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

from api.jobs.stream import JobEvents
from shared.errors import RelayError
from shared.events import DeltaEvent, EndEvent, ErrorEvent, StartEvent
from shared.responses_api import ResponsesRequest


def response_id(job_id: str) -> str:
    return f"resp_{job_id}"


@dataclass
class _Item:
    kind: str  # "reasoning", "message" or "function_call"
    item_id: str
    text: str = ""
    call_id: str = ""
    name: str = ""

    def as_dict(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": self.text}] if status == "completed" else []
            return {"type": "reasoning", "id": self.item_id, "summary": [], "content": content, "status": status}
        if self.kind == "message":
            parts = [_text_part(self.text)] if status == "completed" else []
            return {"type": "message", "id": self.item_id, "role": "assistant", "status": status, "content": parts}
        arguments = self.text if status == "completed" else ""
        return {
            "type": "function_call", "id": self.item_id, "call_id": self.call_id, "name": self.name,
            "arguments": arguments, "status": status,
        }  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class ResponseBuilder:
    """The response as the events say so far; ``feed`` returns the stream events each one makes."""

    request: ResponsesRequest
    job_id: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[_Item] = field(default_factory=list)
    calls: dict[int, int] = field(default_factory=dict)  # tool call index → item index
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    is_open: bool = False  # the last item still takes deltas

    @property
    def id(self) -> str:
        return response_id(self.job_id)

    def feed(self, event: object) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if isinstance(event, StartEvent):
            self.input_tokens = event.prompt_tokens
        elif isinstance(event, EndEvent):
            usage = event.usage
            self.input_tokens, self.output_tokens, self.cached_tokens = (
                usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
            )  # fmt: skip
        elif isinstance(event, DeltaEvent) and event.index == 0:
            if event.reasoning:
                out += self._text("reasoning", event.reasoning)
            if event.content:
                out += self._text("message", event.content)
            for call in event.tool_calls or []:
                if call.id is not None or call.index not in self.calls:
                    out += self.close()
                    item = _Item("function_call", f"fc_{self.job_id}_{len(self.items)}", call_id=call.id or "")
                    item.name = call.name or ""
                    self.items.append(item)
                    self.calls[call.index] = len(self.items) - 1
                    self.is_open = True
                    out.append(
                        {"type": "response.output_item.added", **self._where(), "item": item.as_dict("in_progress")}
                    )
                if call.arguments:
                    index = self.calls[call.index]
                    self.items[index].text += call.arguments
                    item_id = self.items[index].item_id
                    out.append({
                        "type": "response.function_call_arguments.delta", "item_id": item_id, "output_index": index,
                        "delta": call.arguments,
                    })  # fmt: skip
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
        return out

    def _where(self) -> dict[str, Any]:
        return {"output_index": len(self.items) - 1}

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not (self.is_open and self.items and self.items[-1].kind == kind):
            out += self.close()
            prefix = "rs" if kind == "reasoning" else "msg"
            item = _Item(kind, f"{prefix}_{self.job_id}_{len(self.items)}")
            self.items.append(item)
            self.is_open = True
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
            out.append({"type": "response.output_item.added", **self._where(), "item": item.as_dict("in_progress")})
            out.append({"type": "response.content_part.added", **self._part_where(), "part": part})
        self.items[-1].text += text
        delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        delta: dict[str, Any] = {"type": delta_type, **self._part_where(), "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        out.append(delta)
        return out

    def _part_where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1].item_id, "output_index": len(self.items) - 1, "content_index": 0}

    def close(self) -> list[dict[str, Any]]:
        """The events that finish the open item, if any."""
        if not (self.is_open and self.items):
            return []
        self.is_open = False
        item = self.items[-1]
        out: list[dict[str, Any]] = []
        if item.kind == "reasoning":
            out.append({"type": "response.reasoning_text.done", **self._part_where(), "text": item.text})
            out.append({"type": "response.content_part.done", **self._part_where(),
                        "part": {"type": "reasoning_text", "text": item.text}})  # fmt: skip
        elif item.kind == "message":
            out.append({"type": "response.output_text.done", **self._part_where(), "text": item.text, "logprobs": []})
            out.append({"type": "response.content_part.done", **self._part_where(), "part": _text_part(item.text)})
        else:
            out.append({"type": "response.function_call_arguments.done", "item_id": item.item_id, **self._where(),
                        "name": item.name, "arguments": item.text})  # fmt: skip
        out.append({"type": "response.output_item.done", **self._where(), "item": item.as_dict("completed")})
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
            usage = {
                "input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens,
            }  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": request.background, "model": request.model,
            "output": [item.as_dict("completed") for item in self.items] if is_final else [],
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
        return "incomplete" if self.finish_reason == "length" else "completed"

    def output_items(self) -> list[dict[str, Any]]:
        return [item.as_dict("completed") for item in self.items]


async def collect_response(stream: JobEvents, builder: ResponseBuilder) -> dict[str, Any]:
    """The non-stream answer; raises RelayError when the job failed before any output."""
    try:
        async for event in stream.events():
            if isinstance(event, ErrorEvent):
                raise event.to_exception()
            builder.feed(event)
    finally:
        await stream.close()
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
        async for event in stream.events():
            if isinstance(event, ErrorEvent):
                raise event.to_exception()
            for out in builder.feed(event):
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
