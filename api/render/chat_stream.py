"""Job events → OpenAI chat completion chunks, sent as server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus

from api.render.accumulator import ChoiceDelta, JobFailed, JobResult, follow
from api.render.events import JobEvents, LiveJobEvents
from api.settings import ApiSettings
from api.wire.openai.chat_response import (
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    LogprobEntry,
    PromptTokensDetails,
    TopLogprobEntry,
    Usage,
)
from shared.errors import RelayError
from shared.events import EndEvent, TokenLogprob, ToolCallDelta, UsageCounts

DONE = "[DONE]"


class KeepAliveComment(ServerSentEvent):
    """A keep-alive that is a bare comment line, not a whole (empty) event.

    The ``openai`` SDK's SSE decoder keeps the last ``id:`` across events, so the blank line after
    a standalone ``: ping`` comment dispatches an event with empty data, which it then fails to
    parse as JSON. A comment line without its own blank line is skipped by every SSE parser and
    still keeps proxies from timing out an idle connection.
    """

    def encode(self) -> bytes:
        return b": keep-alive\n"


def to_usage(counts: UsageCounts) -> Usage:
    details = PromptTokensDetails(cached_tokens=counts.cached_tokens) if counts.cached_tokens else None
    return Usage(
        prompt_tokens=counts.prompt_tokens,
        completion_tokens=counts.completion_tokens,
        total_tokens=counts.prompt_tokens + counts.completion_tokens,
        prompt_tokens_details=details,
    )


def error_chunk(error: RelayError) -> dict[str, str]:
    """The one chunk a failure becomes; a job's own error event keeps its id like any event."""
    data = json.dumps(error.to_body())
    return {"id": str(error.seq), "data": data} if isinstance(error, JobFailed) else {"data": data}


def logprob_entries(logprobs: list[TokenLogprob]) -> list[LogprobEntry]:
    def utf8(token: str) -> list[int]:
        return list(token.encode("utf-8", errors="replace"))

    return [
        LogprobEntry(
            token=entry.token,
            logprob=entry.logprob,
            bytes=utf8(entry.token),
            top_logprobs=[TopLogprobEntry(token=t.token, logprob=t.logprob, bytes=utf8(t.token)) for t in entry.top],
        )
        for entry in logprobs
    ]


def delta_tool_calls(fragments: list[ToolCallDelta] | None) -> list[DeltaToolCall] | None:
    """OpenAI's rules: ``id``, ``type`` and ``name`` only on a call's first fragment."""
    if not fragments:
        return None
    return [
        DeltaToolCall(
            index=call.index,
            id=call.id,
            type="function" if call.id is not None else None,
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )
        for call in fragments
    ]


class ChunkWriter:
    """Builds chunks that all share the job's ``id``, ``created`` and ``model``."""

    def __init__(self, stream: JobEvents, reasoning_field: str) -> None:
        job = stream.job
        self._id, self._created, self._model = job.job_id, job.created, job.served_name
        self.num_choices = job.n
        self._reasoning_field = reasoning_field

    def chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
        ).model_dump_json()

    def role(self, index: int) -> str:
        return self.chunk([ChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])

    def delta(self, added: ChoiceDelta) -> str:
        delta = DeltaMessage(content=added.content, tool_calls=delta_tool_calls(added.tool_calls))
        if added.reasoning:
            setattr(delta, self._reasoning_field, added.reasoning)
        logprobs = ChoiceLogprobs(content=logprob_entries(added.logprobs)) if added.logprobs else None
        choice = ChunkChoice(
            index=added.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=added.finish_reason,
            stop_reason=added.stop_reason,
        )
        return self.chunk([choice])


def sse_response(chunks: AsyncIterator[dict[str, str]], settings: ApiSettings) -> EventSourceResponse:
    """One way to stream: keep-alive comments, and a drain window when the server stops."""
    return EventSourceResponse(
        chunks,
        ping=settings.sse_ping_interval_s,
        ping_message_factory=KeepAliveComment,
        shutdown_grace_period=settings.drain_timeout_s,
    )


async def sse_chunks(
    stream: LiveJobEvents, include_usage: bool, reasoning_field: str, send_role: bool = True
) -> AsyncIterator[dict[str, str]]:
    """The SSE body after the start event: role chunks, deltas, optional usage, ``[DONE]``.

    A failure becomes one ``data: {"error": ...}`` event before ``[DONE]``; a client that
    disconnects cancels this generator, and the job with it.
    """
    writer = ChunkWriter(stream, reasoning_field)
    try:
        # SSE ids are the job's event sequence numbers (the start event is 0), so a client can
        # check that nothing was lost or repeated.
        for index in range(writer.num_choices if send_role else 0):
            yield {"id": "0", "data": writer.role(index)}
        async for event, added in follow(stream, JobResult(writer.num_choices)):
            if added is not None:
                yield {"id": str(event.seq), "data": writer.delta(added)}
            elif isinstance(event, EndEvent) and include_usage:
                yield {"id": str(event.seq), "data": writer.chunk([], to_usage(event.usage))}
    except RelayError as exc:
        yield error_chunk(exc)
    finally:
        # anyio cancels every await in a cancelled scope; the cleanup must still reach Redis.
        with anyio.CancelScope(shield=True):
            await stream.close(keep_job=AppStatus.should_exit)
    yield {"data": DONE}
