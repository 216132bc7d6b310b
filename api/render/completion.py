"""Job events → OpenAI ``text_completion`` objects, streamed as SSE or collected into one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from sse_starlette.sse import AppStatus

from api.jobs.stream import JobEvents, JobStream
from api.render.chat_stream import DONE, to_usage
from shared.errors import ErrorKind, RelayError
from shared.events import DeltaEvent, EndEvent, ErrorEvent
from shared.openai.chat_response import Usage
from shared.openai.completion_request import CompletionRequest
from shared.openai.completion_response import Completion, CompletionChoice, CompletionLogprobs


@dataclass
class _ChoiceState:
    """One choice's echo prefix (sent with its first text) and running text length (for offsets)."""

    prefix: str
    text_length: int = 0
    is_started: bool = False
    parts: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionWriter:
    def __init__(self, stream: JobEvents) -> None:
        job = stream.job
        request = job.request
        assert isinstance(request, CompletionRequest)
        self._id, self._created, self._model = job.job_id, job.created, request.model
        prompts = request.prompts if request.echo else [""] * len(request.prompts)
        self.choices = [_ChoiceState(prefix=str(prompt)) for prompt in prompts for _ in range(request.n)]

    def completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self._id, created=self._created, model=self._model, choices=choices, usage=usage)

    def choice_delta(self, event: DeltaEvent) -> CompletionChoice:
        """The text this event adds to its choice (with the echoed prompt first), and its logprobs."""
        state = self.choices[event.index]
        text = event.content or ""
        if not state.is_started:
            state.is_started = True
            text = state.prefix + text
            state.text_length = len(state.prefix)
        logprobs = self._legacy_logprobs(event, state) if event.logprobs else None
        state.text_length += len(event.content or "")
        return CompletionChoice(
            text=text,
            index=event.index,
            logprobs=logprobs,
            finish_reason=event.finish_reason,
            stop_reason=event.stop_reason,
        )

    @staticmethod
    def _legacy_logprobs(event: DeltaEvent, state: _ChoiceState) -> CompletionLogprobs:
        result = CompletionLogprobs()
        offset = state.text_length
        for entry in event.logprobs or []:
            result.tokens.append(entry.token)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append({top.token: top.logprob for top in entry.top})
            result.text_offset.append(offset)
            offset += len(entry.token)
        return result


async def sse_completion_chunks(stream: JobStream, include_usage: bool) -> AsyncIterator[dict[str, str]]:
    writer = CompletionWriter(stream)
    try:
        async for event in stream.events():
            if isinstance(event, DeltaEvent):
                chunk = writer.completion([writer.choice_delta(event)])
                yield {"id": str(event.seq), "data": chunk.model_dump_json()}
            elif isinstance(event, EndEvent) and include_usage:
                yield {"id": str(event.seq), "data": writer.completion([], to_usage(event.usage)).model_dump_json()}
            elif isinstance(event, ErrorEvent):
                yield {"id": str(event.seq), "data": json.dumps(event.to_exception().to_body())}
    except RelayError as exc:
        yield {"data": json.dumps(exc.to_body())}
    finally:
        with anyio.CancelScope(shield=True):
            await stream.close(keep_job=AppStatus.should_exit)
    yield {"data": DONE}


async def collect_text_completion(stream: JobEvents) -> Completion:
    writer = CompletionWriter(stream)
    usage: Usage | None = None
    try:
        async for event in stream.events():
            if isinstance(event, DeltaEvent):
                _merge(writer.choices[event.index], writer.choice_delta(event))
            elif isinstance(event, EndEvent):
                usage = to_usage(event.usage)
            elif isinstance(event, ErrorEvent):
                raise event.to_exception()
    finally:
        await stream.close()
    if usage is None:
        raise RelayError(ErrorKind.INTERNAL, f"job {stream.job_id} ended without usage")
    choices = [
        CompletionChoice(
            text="".join(state.parts),
            index=index,
            logprobs=state.logprobs,
            finish_reason=state.finish_reason,  # type: ignore[arg-type]
            stop_reason=state.stop_reason,
        )
        for index, state in enumerate(writer.choices)
    ]
    return writer.completion(choices, usage)


def _merge(state: _ChoiceState, delta: CompletionChoice) -> None:
    state.parts.append(delta.text)
    state.finish_reason = delta.finish_reason or state.finish_reason
    state.stop_reason = delta.stop_reason if delta.stop_reason is not None else state.stop_reason
    if delta.logprobs is not None:
        merged = state.logprobs or CompletionLogprobs()
        merged.tokens += delta.logprobs.tokens
        merged.token_logprobs += delta.logprobs.token_logprobs
        merged.top_logprobs += delta.logprobs.top_logprobs
        merged.text_offset += delta.logprobs.text_offset
        state.logprobs = merged
