"""A job's events folded into one result, which every renderer reads.

A whole answer (a ``chat.completion``, a ``text_completion``, a Responses ``response``, an
Anthropic ``message``, embeddings, a token count) is rendered from a :class:`JobResult`'s final
state; a stream follows the same events through :func:`follow` and renders each
:class:`ChoiceDelta` it gets back in its own protocol. How events fold (text by choice, tool calls
by index, the output's items in the order they opened, logprobs with their text offsets, usage,
the job's own error) is therefore written once, and the protocols can only differ in how they
spell it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from api.render.events import JobEvents
from shared.errors import RelayError
from shared.events import (
    AnyEvent,
    DeltaEvent,
    EmbeddingsEvent,
    EndEvent,
    ErrorEvent,
    StartEvent,
    TokenLogprob,
    ToolCallDelta,
    UsageCounts,
)

FinishReason = Literal["stop", "length", "tool_calls"]
ItemKind = Literal["reasoning", "text", "tool_call"]


class JobFailed(RelayError):
    """A job's own error event, raised. ``seq`` is the event's, so that a stream numbers the error
    chunk it becomes like every other event (an error the stream itself saw has no event)."""

    def __init__(self, event: ErrorEvent) -> None:
        super().__init__(event.kind, event.message, event.param)
        self.seq = event.seq


@dataclass
class ToolCall:
    """A tool call assembled from its fragments by index; a fragment's ``id`` or ``name``, when
    it has one, replaces the call's."""

    id: str = ""
    name: str = ""
    argument_parts: list[str] = field(default_factory=list)

    @property
    def arguments(self) -> str:
        return "".join(self.argument_parts)


@dataclass
class OutputItem:
    """One run of a choice's output, in the order the runs opened: reasoning, text, or one tool
    call. Responses output items and Anthropic content blocks are these, one for one."""

    kind: ItemKind
    call_id: str = ""  # a tool call's, as its first fragment gave it
    call_index: int = 0
    name: str = ""
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The reasoning, the text, or the tool call's arguments."""
        return "".join(self.parts)


@dataclass(frozen=True)
class ItemUpdate:
    """What a delta did to one output item: opened it at ``position`` (``is_new``: the item
    before it is then complete, with ``closed_text``) and appended ``text`` (possibly nothing).

    A stream ends the item before as this one opens, with its text as of then: a tool call's
    argument text that arrives later still belongs to its call, and reaches a stream after the
    end it already sent.
    """

    position: int
    item: OutputItem
    is_new: bool
    text: str
    closed_text: str | None = None


@dataclass(frozen=True)
class ChoiceDelta:
    """What one delta event added to its choice. The event's own fields come as the worker sent
    them (a chat chunk repeats them as they are); the rest is what only the choice's state knows."""

    index: int
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCallDelta] | None
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    logprob_offsets: list[int]  # where each of ``logprobs``' tokens starts in the choice's content
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    is_first: bool  # the choice's first delta (seen by this result)
    items: list[ItemUpdate]


@dataclass
class ChoiceState:
    """One choice as its deltas say so far."""

    content_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)  # by the fragments' index
    items: list[OutputItem] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # None until a delta carries some
    logprob_offsets: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_deltas: int = 0
    num_content_chars: int = 0
    _call_positions: dict[int, int] = field(default_factory=dict)  # tool call index → its latest item

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    def apply(self, event: DeltaEvent) -> ChoiceDelta:
        text_offset = self.num_content_chars
        updates: list[ItemUpdate] = []
        if event.reasoning:
            self.reasoning_parts.append(event.reasoning)
            updates.append(self._extend("reasoning", event.reasoning))
        if event.content:
            self.content_parts.append(event.content)
            self.num_content_chars += len(event.content)
            updates.append(self._extend("text", event.content))
        for fragment in event.tool_calls or []:
            self._assemble(fragment)
            update = self._call_item(fragment)
            if update.is_new or update.text:
                updates.append(update)
        offsets = self._add_logprobs(event.logprobs or [], text_offset)
        self.token_ids += event.token_ids
        self.finish_reason = event.finish_reason or self.finish_reason
        if event.stop_reason is not None:
            self.stop_reason = event.stop_reason
        self.num_deltas += 1
        return ChoiceDelta(
            index=event.index,
            content=event.content,
            reasoning=event.reasoning,
            tool_calls=event.tool_calls,
            token_ids=event.token_ids,
            logprobs=event.logprobs,
            logprob_offsets=offsets,
            finish_reason=event.finish_reason,
            stop_reason=event.stop_reason,
            is_first=self.num_deltas == 1,
            items=updates,
        )

    def _extend(self, kind: ItemKind, text: str) -> ItemUpdate:
        """Reasoning and text continue the last item while it is of their kind."""
        is_new = not self.items or self.items[-1].kind != kind
        closed_text = self._open(OutputItem(kind)) if is_new else None
        self.items[-1].parts.append(text)
        return ItemUpdate(len(self.items) - 1, self.items[-1], is_new, text, closed_text)

    def _assemble(self, fragment: ToolCallDelta) -> None:
        call = self.tool_calls.setdefault(fragment.index, ToolCall())
        call.id = fragment.id or call.id
        call.name = fragment.name or call.name
        call.argument_parts.append(fragment.arguments or "")

    def _call_item(self, fragment: ToolCallDelta) -> ItemUpdate:
        """A fragment with an ``id`` (or the first of its index) opens a tool call's item; the
        rest add their argument text to the item its index opened last."""
        is_new = fragment.id is not None or fragment.index not in self._call_positions
        closed_text = None
        if is_new:
            item = OutputItem(
                "tool_call", call_id=fragment.id or "", call_index=fragment.index, name=fragment.name or ""
            )
            closed_text = self._open(item)
            self._call_positions[fragment.index] = len(self.items) - 1
        position = self._call_positions[fragment.index]
        text = fragment.arguments or ""
        if text:
            self.items[position].parts.append(text)
        return ItemUpdate(position, self.items[position], is_new, text, closed_text)

    def _open(self, item: OutputItem) -> str | None:
        """Append ``item``; the text of the item it completes, if any."""
        closed_text = self.items[-1].text if self.items else None
        self.items.append(item)
        return closed_text

    def _add_logprobs(self, logprobs: list[TokenLogprob], text_offset: int) -> list[int]:
        """Each token's offset in the content: the delta's, then each token's text after the last."""
        if not logprobs:
            return []
        offsets: list[int] = []
        for entry in logprobs:
            offsets.append(text_offset)
            text_offset += len(entry.token)
        self.logprobs = (self.logprobs or []) + logprobs
        self.logprob_offsets += offsets
        return offsets


class JobResult:
    """A job as its events say so far: its choices, prompt size, usage and embeddings.

    ``num_choices`` choices exist from the start (a choice the worker never reached still
    renders); ``prompt_tokens`` is the start event's count when the caller read that event first.
    """

    def __init__(self, num_choices: int = 1, prompt_tokens: int | None = None) -> None:
        self.choices = [ChoiceState() for _ in range(num_choices)]
        self.prompt_tokens = prompt_tokens
        self.usage: UsageCounts | None = None
        self.embeddings: list[list[float]] | None = None
        self.error: JobFailed | None = None

    def apply(self, event: AnyEvent) -> ChoiceDelta | None:
        """Fold in the next event; a delta event returns what it added to its choice. An error
        event is kept in ``error`` and raised: it ends the job, as it ends the stream."""
        match event:
            case DeltaEvent():
                return self._choice(event.index).apply(event)
            case StartEvent():
                self.prompt_tokens = event.prompt_tokens
            case EndEvent():
                self.usage = event.usage
            case EmbeddingsEvent():
                self.embeddings = event.vectors
            case ErrorEvent():
                self.error = JobFailed(event)
                raise self.error
        return None

    @property
    def num_prompt_tokens(self) -> int:
        """The end event's count, else the start event's (0 before either)."""
        if self.usage is not None:
            return self.usage.prompt_tokens
        return self.prompt_tokens or 0

    @property
    def num_completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else 0

    @property
    def num_cached_tokens(self) -> int:
        return self.usage.cached_tokens if self.usage is not None else 0

    def _choice(self, index: int) -> ChoiceState:
        while index >= len(self.choices):
            self.choices.append(ChoiceState())
        return self.choices[index]


async def follow(stream: JobEvents, result: JobResult) -> AsyncIterator[tuple[AnyEvent, ChoiceDelta | None]]:
    """The job's events in order, each applied to ``result``, with what a delta event added.

    The one loop over a job's events: an error event raises :class:`JobFailed` from here (as a
    :class:`RelayError` the stream raises does), and the stream stays open for the caller to close.
    """
    async for event in stream.events():
        yield event, result.apply(event)


async def collect(stream: JobEvents, result: JobResult) -> JobResult:
    """Fold the whole stream into ``result`` for an answer that is rendered once; the stream is
    closed however it ends."""
    try:
        async for _ in follow(stream, result):
            pass
    finally:
        await stream.close()
    return result
