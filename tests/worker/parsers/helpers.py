"""Feeding parsers whole and in pieces, and rebuilding the message the way OpenAI clients do."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from worker.parsers.base import ParsedDelta, ReasoningParser, ToolParser
from worker.parsers.qwen3_reasoning import Qwen3ReasoningParser


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str
    id: str = ""  # compared too when given; sequential_ids() makes them predictable


@dataclass
class Message:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[Call] = field(default_factory=list)


def sequential_ids() -> Callable[[], str]:
    """Deterministic call ids, so two runs over the same text compare equal."""
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def split_at(text: str, cuts: Iterable[int]) -> list[str]:
    bounds = sorted({0, len(text), *(cut for cut in cuts if 0 <= cut <= len(text))})
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def every_way_to_split(text: str) -> Iterable[list[str]]:
    """Whole, char by char, and cut once at every index."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def run(parser: ToolParser | ReasoningParser, pieces: Iterable[str]) -> list[ParsedDelta]:
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return deltas


def assemble(deltas: Iterable[ParsedDelta]) -> Message:
    """Rebuild the message as the OpenAI SDK and qwen-code do, checking OpenAI's streaming rules:
    a call's first fragment has id, name and ``arguments: ""``; later ones only arguments; calls come
    one after another with indexes 0, 1, 2…; ids are unique; each call's arguments are JSON."""
    message = Message()
    calls: list[dict[str, str]] = []
    for delta in deltas:
        message.content += delta.content
        message.reasoning += delta.reasoning
        for fragment in delta.tool_calls:
            if fragment.index == len(calls):
                assert fragment.id and fragment.name is not None and fragment.arguments == "", fragment
                calls.append({"id": fragment.id, "name": fragment.name, "arguments": ""})
            else:
                assert fragment.index == len(calls) - 1, f"fragment for an earlier or unknown call: {fragment}"
                assert fragment.id is None and fragment.name is None, fragment
                calls[-1]["arguments"] += fragment.arguments or ""
    assert len({call["id"] for call in calls}) == len(calls), calls
    for call in calls:
        json.loads(call["arguments"])
    message.tool_calls = [Call(**call) for call in calls]
    return message


def parse_tools(
    parser_class: type[ToolParser], pieces: Iterable[str], tools: list[dict[str, Any]] | None = None
) -> Message:
    parser = parser_class(tools or [], new_call_id=sequential_ids())
    message = assemble(run(parser, pieces))
    assert parser.num_tool_calls == len(message.tool_calls)
    return message


def parse_reasoning(pieces: Iterable[str], starts_in_reasoning: bool = False) -> Message:
    return assemble(run(Qwen3ReasoningParser(starts_in_reasoning), pieces))


def without_ids(message: Message) -> Message:
    calls = [Call(call.name, call.arguments) for call in message.tool_calls]
    return Message(message.content, message.reasoning, calls)


def cuts_for(text: str) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(min_value=0, max_value=len(text)), max_size=24)


# Free model text: partial tags, JSON punctuation, escapes and non-ASCII, but never a whole tag
# (there is no "_" or "=", and "think>" is filtered where it matters).
FREE_FRAGMENTS = [
    "a",
    "b",
    " ",
    "\n",
    "<",
    "/",
    ">",
    "{",
    "}",
    '"',
    "\\",
    "é",
    "😀",
    "<tool",
    "</tool",
    "call>",
    "<thi",
]
free_text = st.lists(st.sampled_from(FREE_FRAGMENTS), max_size=8).map("".join)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**12), max_value=10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from(["a", " ", '"', "\\", "\n", "\t", "\x01", "é", "😀", "<", "/", "}"]), max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)
