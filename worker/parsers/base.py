"""What every parser implements, and the registries that find them by name.

A sequence's text flows: detokenizer → stop strings → reasoning parser → tool parser → delta.
Parsers are fed text deltas of any size (a token can be several characters, a character can
arrive over several tokens) and must give the same result however the text is split: feeding
the whole text at once is the non-stream result, and the streamed fragments concatenate to it.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shared.events import ToolCallDelta


def new_tool_call_id() -> str:
    """OpenAI-style call id: ``call_`` and 24 hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)


class ReasoningParser(ABC):
    """Splits a sequence's text into reasoning and content."""

    name: ClassVar[str]

    def __init__(self, starts_in_reasoning: bool) -> None:
        """``starts_in_reasoning``: the prompt already opened the reasoning block (e.g. ends in
        ``<think>\\n``), so text is reasoning until the closing tag."""
        self.starts_in_reasoning = starts_in_reasoning

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """New text in; reasoning and content that became certain out (partial tags are held)."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """End of generation: release whatever is held."""


class ToolParser(ABC):
    """Turns tool-call markup in the content into OpenAI tool-call deltas."""

    name: ClassVar[str]

    def __init__(self, tools: list[dict[str, Any]], new_call_id: Callable[[], str] = new_tool_call_id) -> None:
        """``tools``: the request's tool definitions as OpenAI dicts ({"type", "function": {...}}),
        used e.g. to type parameter values from their JSON schema."""
        self.tools = tools
        self.new_call_id = new_call_id

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """New content text in; content and tool-call deltas that became certain out."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """End of generation: release held text, close an unterminated call if one is open."""

    @property
    @abstractmethod
    def num_tool_calls(self) -> int:
        """Tool calls started so far (finish_reason becomes ``tool_calls`` when > 0)."""


_TOOL_PARSERS: dict[str, type[ToolParser]] = {}
_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        _TOOL_PARSERS[name] = cls
        return cls

    return register


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        cls.name = name
        _REASONING_PARSERS[name] = cls
        return cls

    return register


def tool_parser_class(name: str) -> type[ToolParser]:
    try:
        return _TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {sorted(_TOOL_PARSERS)}") from None


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    try:
        return _REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(_REASONING_PARSERS)}") from None


def tool_parser_names() -> list[str]:
    return sorted(_TOOL_PARSERS)


def reasoning_parser_names() -> list[str]:
    return sorted(_REASONING_PARSERS)
