"""``<tool_call>`` block framing shared by the tool parsers: text outside blocks is content, a block
that turns out not to be a call goes back into the content verbatim, and a block that is a call is
read by a per-format ``CallReader``.

A format may also take a *lead* block: markup that small models write instead of the tags (Qwen2.5
Coder answers with a fenced ``json`` object), accepted only as the first thing the model writes and
only when it names one of the request's tools, as llama.cpp's hermes parser accepts it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from shared.events import ToolCallDelta
from worker.parsers.base import ParsedDelta, ToolParser, new_tool_call_id

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def split_at_first_tag(text: str, tags: tuple[str, ...]) -> tuple[str, str, str]:
    """``(before, tag, after)`` around the first complete tag. Without one, ``tag`` is "" and ``after``
    is the end of ``text`` that could still grow into a tag: it has to wait for more text."""
    hits = [(at, tag) for tag in tags if (at := text.find(tag)) >= 0]
    if hits:
        at, tag = min(hits)
        return text[:at], tag, text[at + len(tag) :]
    cut = len(text) - _partial_tag_len(text, tags)
    return text[:cut], "", text[cut:]


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``tags``."""
    longest = 0
    for tag in tags:
        longest = max(longest, next((n for n in range(len(tag) - 1, longest, -1) if text.endswith(tag[:n])), 0))
    return longest


class CallReader(ABC):
    """Reads the body of one ``<tool_call>`` block, fed in pieces; never sees the closing tag."""

    def __init__(self, index: int, new_call_id: Callable[[], str]) -> None:
        self.index = index
        self._new_call_id = new_call_id
        self.has_call = False  # the header went out: the block is a call for good
        self.is_malformed = False  # the block cannot be a call: it goes back into the content

    @abstractmethod
    def feed(self, text: str) -> list[ToolCallDelta]:
        """Body text in; the call's header and argument fragments that became certain out."""

    @abstractmethod
    def close(self) -> list[ToolCallDelta]:
        """The block ended (closing tag or end of generation): complete the call or give up on it."""

    def _header(self, name: str) -> ToolCallDelta:
        self.has_call = True
        return ToolCallDelta(index=self.index, id=self._new_call_id(), name=name, arguments="")

    def _argument_deltas(self, arguments: str) -> list[ToolCallDelta]:
        return [ToolCallDelta(index=self.index, arguments=arguments)] if arguments else []


class ToolCallBlockParser(ToolParser):
    """Content with ``<tool_call>`` blocks in it; subclasses say how a block's body is read."""

    # Lead block opener → its closer (see the module docstring); none by default.
    lead_blocks: ClassVar[dict[str, str]] = {}

    def __init__(self, tools: list[dict[str, Any]], new_call_id: Callable[[], str] = new_tool_call_id) -> None:
        super().__init__(tools, new_call_id)
        self._pending = ""  # text not yet decided on: part of a tag, or blanks at a call boundary
        self._reader: CallReader | None = None  # the open block's reader; None outside blocks
        self._opener, self._closer = TOOL_CALL_START, TOOL_CALL_END  # the open block's markup
        self._block_text = ""  # the open block's body so far, to give back if it is no call
        self._is_given_back = False  # the open block went back into the content
        self._num_closed_calls = 0
        # Blanks before the first call, between calls and after the last are layout, not content.
        self._is_at_call_boundary = True
        self._is_at_start = True  # nothing but blanks written yet: a lead block may open
        self._tool_names = frozenset(name for t in tools if (name := t.get("function", {}).get("name")))

    @abstractmethod
    def _new_reader(self, index: int, allowed_names: frozenset[str] | None = None) -> CallReader:
        """``allowed_names``: a call naming another tool is no call (lead blocks only)."""

    @property
    def num_tool_calls(self) -> int:
        return self._num_closed_calls + int(self._reader is not None and self._reader.has_call)

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        delta = ParsedDelta()
        while self._read_block(delta) if self._reader else self._read_content(delta):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        delta = ParsedDelta()
        held, self._pending = self._pending, ""
        if self._reader is not None:
            self._feed_block(held, delta)
            self._close_block("", delta)
        elif not (self._is_at_call_boundary and held.isspace()):
            delta.content += held
        return delta

    def _read_content(self, delta: ParsedDelta) -> bool:
        """Content up to the next block; False when the rest has to wait for more text."""
        if self._is_at_call_boundary and not self._settle_call_boundary():
            return False
        if self._is_at_start:
            self._is_at_start = False
            lead = next((opener for opener in self.lead_blocks if self._pending.startswith(opener)), None)
            if lead is not None:
                self._pending = self._pending[len(lead) :]
                self._open_block(lead, self.lead_blocks[lead], self._tool_names)
                return True
        text, tag, self._pending = split_at_first_tag(self._pending, (TOOL_CALL_START,))
        delta.content += text
        if tag:
            self._open_block(TOOL_CALL_START, TOOL_CALL_END, None)
        return bool(tag)

    def _open_block(self, opener: str, closer: str, allowed_names: frozenset[str] | None) -> None:
        self._opener, self._closer = opener, closer
        self._reader = self._new_reader(self.num_tool_calls, allowed_names)

    def _settle_call_boundary(self) -> bool:
        """Drop the blanks at a call boundary if a block follows, keep them if text does."""
        rest = self._pending.lstrip()
        openers = (TOOL_CALL_START, *self.lead_blocks) if self._is_at_start else (TOOL_CALL_START,)
        if any(rest.startswith(opener) for opener in openers):
            self._pending = rest
        elif any(opener.startswith(rest) for opener in openers):
            return False
        self._is_at_call_boundary = False
        return True

    def _read_block(self, delta: ParsedDelta) -> bool:
        text, tag, self._pending = split_at_first_tag(self._pending, (self._closer,))
        self._feed_block(text, delta)
        if tag:
            self._close_block(tag, delta)
        return bool(tag)

    def _feed_block(self, text: str, delta: ParsedDelta) -> None:
        assert self._reader is not None
        if self._is_given_back:
            delta.content += text
            return
        self._block_text += text
        delta.tool_calls += self._reader.feed(text)
        self._give_back_if_malformed(delta)

    def _close_block(self, end_tag: str, delta: ParsedDelta) -> None:
        assert self._reader is not None
        if not self._is_given_back:
            delta.tool_calls += self._reader.close()
            self._give_back_if_malformed(delta)
        if self._is_given_back:
            delta.content += end_tag
        else:
            self._num_closed_calls += 1
            self._is_at_call_boundary = True
        self._reader, self._block_text, self._is_given_back = None, "", False

    def _give_back_if_malformed(self, delta: ParsedDelta) -> None:
        """A block that cannot be a call was model text after all: it becomes content, tags included."""
        if self._reader is not None and self._reader.is_malformed:
            delta.content += self._opener + self._block_text
            self._is_given_back = True
