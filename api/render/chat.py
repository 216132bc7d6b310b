"""Job events → one ``chat.completion`` object (non-stream requests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from api.jobs.stream import JobEvents
from api.render.chat_stream import logprob_entries, to_usage
from shared.errors import ErrorKind, RelayError
from shared.events import DeltaEvent, EndEvent, ErrorEvent
from shared.openai.chat_response import (
    ChatCompletion,
    Choice,
    ChoiceLogprobs,
    LogprobEntry,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
    Usage,
)


@dataclass
class _ToolCallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class _ChoiceParts:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, _ToolCallParts] = field(default_factory=dict)
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, event: DeltaEvent) -> None:
        if event.content:
            self.content.append(event.content)
        if event.reasoning:
            self.reasoning.append(event.reasoning)
        for fragment in event.tool_calls or []:
            call = self.tool_calls.setdefault(fragment.index, _ToolCallParts())
            call.id = fragment.id or call.id
            call.name = fragment.name or call.name
            call.arguments.append(fragment.arguments or "")
        if event.logprobs:
            self.logprobs = (self.logprobs or []) + logprob_entries(event)
        self.finish_reason = event.finish_reason or self.finish_reason
        self.stop_reason = event.stop_reason if event.stop_reason is not None else self.stop_reason

    def message(self, reasoning_field: str) -> ResponseMessage:
        tool_calls = [
            ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments="".join(c.arguments)))
            for _, c in sorted(self.tool_calls.items())
        ]
        content: str | None = "".join(self.content)
        if tool_calls and not content:
            content = None  # OpenAI sends null content beside tool calls
        message = ResponseMessage(content=content, tool_calls=tool_calls or None)
        if self.reasoning:
            setattr(message, reasoning_field, "".join(self.reasoning))
        return message


async def collect_completion(stream: JobEvents, reasoning_field: str) -> ChatCompletion:
    """Read the whole stream into a ``chat.completion``; an error event raises RelayError."""
    choices = [_ChoiceParts() for _ in range(stream.job.request.n)]
    usage: Usage | None = None
    try:
        async for event in stream.events():
            if isinstance(event, DeltaEvent):
                choices[event.index].add(event)
            elif isinstance(event, EndEvent):
                usage = to_usage(event.usage)
            elif isinstance(event, ErrorEvent):
                raise event.to_exception()
    finally:
        await stream.close()
    if usage is None:
        raise RelayError(ErrorKind.INTERNAL, f"job {stream.job_id} ended without usage")
    job = stream.job
    return ChatCompletion(
        id=job.job_id,
        created=job.created,
        model=job.request.model,
        choices=[
            Choice(
                index=i,
                message=c.message(reasoning_field),
                logprobs=ChoiceLogprobs(content=c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason,  # type: ignore[arg-type]
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(choices)
        ],
        usage=usage,
    )
