"""A chat job's result → one ``chat.completion`` object (non-stream requests)."""

from __future__ import annotations

from api.render.accumulator import ChoiceState, JobResult, collect
from api.render.chat_stream import logprob_entries, to_usage
from api.render.events import JobEvents
from api.wire.openai.chat_response import (
    ChatCompletion,
    Choice,
    ChoiceLogprobs,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
)
from shared.errors import ErrorKind, RelayError


def _message(choice: ChoiceState, reasoning_field: str) -> ResponseMessage:
    tool_calls = [
        ResponseToolCall(id=call.id, function=ResponseFunctionCall(name=call.name, arguments=call.arguments))
        for _, call in sorted(choice.tool_calls.items())
    ]
    content: str | None = choice.content
    if tool_calls and not content:
        content = None  # OpenAI sends null content beside tool calls
    message = ResponseMessage(content=content, tool_calls=tool_calls or None)
    if choice.reasoning_parts:
        setattr(message, reasoning_field, choice.reasoning)
    return message


def _choice(index: int, choice: ChoiceState, reasoning_field: str) -> Choice:
    logprobs = ChoiceLogprobs(content=logprob_entries(choice.logprobs)) if choice.logprobs is not None else None
    return Choice(
        index=index,
        message=_message(choice, reasoning_field),
        logprobs=logprobs,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
    )


async def collect_completion(stream: JobEvents, reasoning_field: str) -> ChatCompletion:
    """Read the whole stream into a ``chat.completion``; an error event raises RelayError."""
    job = stream.job
    model, num_choices = job.served_name, job.n
    result = await collect(stream, JobResult(num_choices))
    if result.usage is None:
        raise RelayError(ErrorKind.INTERNAL, f"job {stream.job_id} ended without usage")
    return ChatCompletion(
        id=job.job_id,
        created=job.created,
        model=model,
        choices=[_choice(index, choice, reasoning_field) for index, choice in enumerate(result.choices)],
        usage=to_usage(result.usage),
    )
