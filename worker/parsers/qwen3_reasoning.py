"""Qwen3 thinking: ``<think>…</think>`` and then the answer.

Templates from Qwen3-2507 on open the block in the prompt (``starts_in_reasoning``); older ones make
the model emit ``<think>`` itself, so a leading ``<think>`` is stripped either way. Without one (and
with the prompt not opening the block) the whole text is content. Text held as a possible tag is
released on ``finish()`` as whatever it turned out to be.
"""

from __future__ import annotations

from enum import Enum, auto

from worker.parsers.base import ParsedDelta, ReasoningParser, register_reasoning_parser

THINK_START = "<think>"
THINK_END = "</think>"


class _Phase(Enum):
    OPENING = auto()  # a leading <think> may still come
    REASONING = auto()
    AFTER_REASONING = auto()  # blanks after </think> are layout, not content
    CONTENT = auto()


def _partial_end_tag_len(text: str) -> int:
    """Length of the end of ``text`` that could still grow into ``</think>``."""
    return next((n for n in range(len(THINK_END) - 1, 0, -1) if text.endswith(THINK_END[:n])), 0)


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    def __init__(self, starts_in_reasoning: bool) -> None:
        super().__init__(starts_in_reasoning)
        self._phase = _Phase.OPENING
        self._pending = ""  # text not yet decided on: part of a tag, or blanks after </think>

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        delta = ParsedDelta()
        while self._advance(delta):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        if self._phase is _Phase.OPENING:
            self._phase = self._phase_without_opening_tag()
        held, self._pending = self._pending, ""
        if self._phase is _Phase.REASONING:
            return ParsedDelta(reasoning=held)
        if self._phase is _Phase.CONTENT:
            return ParsedDelta(content=held)
        return ParsedDelta()

    def _advance(self, delta: ParsedDelta) -> bool:
        """Consume what can be decided now; False when the rest has to wait for more text."""
        if self._phase is _Phase.OPENING:
            return self._read_opening()
        if self._phase is _Phase.REASONING:
            return self._read_reasoning(delta)
        if self._phase is _Phase.AFTER_REASONING:
            return self._skip_blanks()
        delta.content += self._pending
        self._pending = ""
        return False

    def _read_opening(self) -> bool:
        if self._pending.startswith(THINK_START):
            self._pending = self._pending[len(THINK_START) :]
            self._phase = _Phase.REASONING
            return True
        if THINK_START.startswith(self._pending):
            return False
        self._phase = self._phase_without_opening_tag()
        return True

    def _phase_without_opening_tag(self) -> _Phase:
        return _Phase.REASONING if self.starts_in_reasoning else _Phase.CONTENT

    def _read_reasoning(self, delta: ParsedDelta) -> bool:
        end = self._pending.find(THINK_END)
        if end < 0:
            cut = len(self._pending) - _partial_end_tag_len(self._pending)
            delta.reasoning += self._pending[:cut]
            self._pending = self._pending[cut:]
            return False
        delta.reasoning += self._pending[:end]
        self._pending = self._pending[end + len(THINK_END) :]
        self._phase = _Phase.AFTER_REASONING
        return True

    def _skip_blanks(self) -> bool:
        self._pending = self._pending.lstrip()
        if not self._pending:
            return False
        self._phase = _Phase.CONTENT
        return True
