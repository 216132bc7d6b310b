"""One sequence's text after stop strings: reasoning split off first, then tool calls extracted
from what remains."""

from __future__ import annotations

from worker.parsers.base import ParsedDelta, ReasoningParser, ToolParser


class TextPipeline:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def num_tool_calls(self) -> int:
        return self._tools.num_tool_calls if self._tools is not None else 0

    def feed(self, text: str) -> ParsedDelta:
        split = self._reasoning.feed(text) if self._reasoning is not None else ParsedDelta(content=text)
        return self._extract_calls(split)

    def finish(self) -> ParsedDelta:
        split = self._reasoning.finish() if self._reasoning is not None else ParsedDelta()
        delta = self._extract_calls(split)
        if self._tools is not None:
            delta.extend(self._tools.finish())
        return delta

    def _extract_calls(self, split: ParsedDelta) -> ParsedDelta:
        if self._tools is None or not split.content:
            return split
        calls = self._tools.feed(split.content)
        return ParsedDelta(content=calls.content, reasoning=split.reasoning, tool_calls=calls.tool_calls)
