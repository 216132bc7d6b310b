"""A completion job's events → OpenAI ``text_completion`` objects, streamed as SSE or collected into one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from sse_starlette.sse import AppStatus

from api.render.accumulator import ChoiceDelta, ChoiceState, JobResult, collect, follow
from api.render.chat_stream import DONE, error_chunk, to_usage
from api.render.events import JobEvents, LiveJobEvents
from api.wire.openai.chat_response import Usage
from api.wire.openai.completion_response import Completion, CompletionChoice, CompletionLogprobs
from shared.contract import Generate
from shared.errors import ErrorKind, RelayError
from shared.events import EndEvent, TokenLogprob


class CompletionWriter:
    """Builds completions that share the job's ``id``, ``created`` and ``model``; each choice's
    text starts with its echo prefix (the prompt, with ``echo``), which its logprob offsets count."""

    def __init__(self, stream: JobEvents) -> None:
        job = stream.job
        request = job.request
        assert isinstance(request, Generate) and request.prompts is not None
        self._id, self._created, self._model = job.job_id, job.created, request.served_name
        prompts = request.prompts if job.delivery.echo else [""] * len(request.prompts)
        self.prefixes = [str(prompt) for prompt in prompts for _ in range(request.n)]

    def new_result(self) -> JobResult:
        return JobResult(len(self.prefixes))

    def completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self._id, created=self._created, model=self._model, choices=choices, usage=usage)

    def choice_delta(self, added: ChoiceDelta) -> CompletionChoice:
        """The text a delta adds to its choice (with the echoed prompt first), and its logprobs."""
        prefix = self.prefixes[added.index]
        text = added.content or ""
        logprobs = _legacy_logprobs(added.logprobs, added.logprob_offsets, len(prefix)) if added.logprobs else None
        return CompletionChoice(
            text=prefix + text if added.is_first else text,
            index=added.index,
            logprobs=logprobs,
            finish_reason=added.finish_reason,
            stop_reason=added.stop_reason,
        )

    def choice(self, index: int, choice: ChoiceState) -> CompletionChoice:
        """A whole choice; one that never started has no text, not even its prefix."""
        prefix = self.prefixes[index]
        logprobs = choice.logprobs
        return CompletionChoice(
            text=prefix + choice.content if choice.num_deltas else "",
            index=index,
            logprobs=_legacy_logprobs(logprobs, choice.logprob_offsets, len(prefix)) if logprobs is not None else None,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )


def _legacy_logprobs(logprobs: list[TokenLogprob], offsets: list[int], prefix_length: int) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[entry.token for entry in logprobs],
        token_logprobs=[entry.logprob for entry in logprobs],
        top_logprobs=[{top.token: top.logprob for top in entry.top} for entry in logprobs],
        text_offset=[prefix_length + offset for offset in offsets],
    )


async def sse_completion_chunks(stream: LiveJobEvents, include_usage: bool) -> AsyncIterator[dict[str, str]]:
    writer = CompletionWriter(stream)
    try:
        async for event, added in follow(stream, writer.new_result()):
            if added is not None:
                chunk = writer.completion([writer.choice_delta(added)])
                yield {"id": str(event.seq), "data": chunk.model_dump_json()}
            elif isinstance(event, EndEvent) and include_usage:
                yield {"id": str(event.seq), "data": writer.completion([], to_usage(event.usage)).model_dump_json()}
    except RelayError as exc:
        yield error_chunk(exc)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.close(keep_job=AppStatus.should_exit)
    yield {"data": DONE}


async def collect_text_completion(stream: JobEvents) -> Completion:
    writer = CompletionWriter(stream)
    result = await collect(stream, writer.new_result())
    if result.usage is None:
        raise RelayError(ErrorKind.INTERNAL, f"job {stream.job_id} ended without usage")
    choices = [writer.choice(index, choice) for index, choice in enumerate(result.choices)]
    return writer.completion(choices, to_usage(result.usage))
