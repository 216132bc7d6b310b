"""Qwen3-Coder tool calls: typed parameters, streamed string values, and any split agreeing with the whole."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.parsers.helpers import (
    Call,
    Message,
    cuts_for,
    every_way_to_split,
    free_text,
    json_values,
    parse_tools,
    sequential_ids,
    split_at,
    without_ids,
)
from worker.parsers.base import tool_parser_class
from worker.parsers.qwen3_coder import Qwen3CoderToolParser, typed_value


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    _tool(
        "run",
        {
            "command": {"type": "string"},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "force": {"type": "boolean"},
            "paths": {"type": "array", "items": {"type": "string"}},
            "env": {"type": "object"},
            "limit": {"type": ["integer", "null"]},
            "mode": {"enum": ["fast", "slow"]},
        },
    )
]


def _parameter(name: str, value: str) -> str:
    return f"<parameter={name}>\n{value}\n</parameter>\n"


def _call(name: str, *parameters: str, closing: str = "</function>\n</tool_call>") -> str:
    return f"<tool_call>\n<function={name}>\n{''.join(parameters)}{closing}"


def _args(**values: Any) -> str:
    return json.dumps(values)


CASES: dict[str, tuple[str, Message]] = {
    "plain text": ("print('<b>')\n", Message(content="print('<b>')\n")),
    "text then a call": (
        "I'll run it.\n" + _call("run", _parameter("command", "ls -la")),
        Message(content="I'll run it.\n", tool_calls=[Call("run", _args(command="ls -la"))]),
    ),
    "every type": (
        _call(
            "run",
            _parameter("command", 'echo "a\\b" é 😀'),
            _parameter("count", "3"),
            _parameter("ratio", "2.5"),
            _parameter("force", "True"),
            _parameter("paths", '["a", "b"]'),
            _parameter("env", '{"A": {"B": [1, null]}}'),
            _parameter("limit", "null"),
            _parameter("mode", "fast"),
        ),
        Message(
            tool_calls=[
                Call(
                    "run",
                    _args(
                        command='echo "a\\b" é 😀',
                        count=3,
                        ratio=2.5,
                        force=True,
                        paths=["a", "b"],
                        env={"A": {"B": [1, None]}},
                        limit=None,
                        mode="fast",
                    ),
                )
            ]
        ),
    ),
    "multi-line string keeps inner newlines": (
        _call("run", _parameter("command", "\nline 1\n\n  line 2\n")),
        Message(tool_calls=[Call("run", _args(command="\nline 1\n\n  line 2\n"))]),
    ),
    "values that do not convert stay strings": (
        _call("run", _parameter("count", "three"), _parameter("force", "yes"), _parameter("env", "{oops")),
        Message(tool_calls=[Call("run", _args(count="three", force="yes", env="{oops"))]),
    ),
    "python literals for arrays and objects": (
        _call("run", _parameter("paths", "['a', 'b']"), _parameter("env", "{'on': True}")),
        Message(tool_calls=[Call("run", _args(paths=["a", "b"], env={"on": True}))]),
    ),
    "unknown parameter and unknown function are strings": (
        _call("run", _parameter("extra", "42")) + _call("other", _parameter("n", "1")),
        Message(tool_calls=[Call("run", _args(extra="42")), Call("other", _args(n="1"))]),
    ),
    "number as written": (
        _call("run", _parameter("ratio", "7")) + _call("run", _parameter("ratio", "1e3")),
        Message(tool_calls=[Call("run", _args(ratio=7)), Call("run", _args(ratio=1000.0))]),
    ),
    "no parameters": (_call("run"), Message(tool_calls=[Call("run", "{}")])),
    "missing </parameter> before the next parameter and </function>": (
        _call("run", "<parameter=command>\nls\n", "<parameter=count>\n2\n"),
        Message(tool_calls=[Call("run", _args(command="ls", count=2))]),
    ),
    "missing </function> and </tool_call>": (
        "<tool_call>\n<function=run>\n<parameter=command>\nls\n</parameter>\n",
        Message(tool_calls=[Call("run", _args(command="ls"))]),
    ),
    "cut off inside a value": (
        "<tool_call>\n<function=run>\n<parameter=command>\nls </par",
        Message(tool_calls=[Call("run", _args(command="ls </par"))]),
    ),
    "cut off inside a parameter name": (
        "<tool_call>\n<function=run>\n<parameter=count>\n1\n</parameter>\n<parameter=com",
        Message(tool_calls=[Call("run", _args(count=1))]),
    ),
    "no function falls back to content": (
        "<tool_call>\nnot a function\n</tool_call>",
        Message(content="<tool_call>\nnot a function\n</tool_call>"),
    ),
    "unfinished function tag falls back to content": (
        "<tool_call>\n<function=ru",
        Message(content="<tool_call>\n<function=ru"),
    ),
    "function tag without > falls back to content": (
        "<tool_call>\n<function=run\n<parameter=a>\nx\n</parameter>\n</tool_call>",
        Message(content="<tool_call>\n<function=run\n<parameter=a>\nx\n</parameter>\n</tool_call>"),
    ),
    "several calls, blanks between them are layout": (
        _call("run", _parameter("command", "a")) + "\n" + _call("run", _parameter("command", "b")) + "\n",
        Message(tool_calls=[Call("run", _args(command="a")), Call("run", _args(command="b"))]),
    ),
}


@pytest.mark.parametrize("text, expected", CASES.values(), ids=CASES.keys())
def test_table_whole_and_split_every_way(text: str, expected: Message) -> None:
    for pieces in every_way_to_split(text):
        assert without_ids(parse_tools(Qwen3CoderToolParser, pieces, TOOLS)) == expected, pieces


def test_registered_by_name() -> None:
    assert tool_parser_class("qwen3_coder") is Qwen3CoderToolParser


@pytest.mark.parametrize(
    "text, schema_type, expected",
    [
        ("12", "integer", 12),
        ("1.5", "integer", "1.5"),
        ("-3", "number", -3),
        ("NaN", "number", "NaN"),
        ("1e999", "number", "1e999"),
        ("FALSE", "boolean", False),
        ("Null", "array", None),
        ("null", "string", "null"),
        ("[1, NaN]", "array", "[1, NaN]"),
        ("{1, 2}", "array", "{1, 2}"),  # a Python set is no JSON
        (" 5 ", "integer", 5),
        ("5", "weird", "5"),
    ],
)
def test_typed_value(text: str, schema_type: str, expected: Any) -> None:
    assert typed_value(text, schema_type) == expected


def _fragments(parser: Qwen3CoderToolParser, text: str) -> str:
    return "".join(call.arguments or "" for call in parser.feed(text).tool_calls)


def test_string_values_stream_and_hold_only_what_may_be_layout_or_a_tag() -> None:
    parser = Qwen3CoderToolParser(TOOLS, new_call_id=sequential_ids())
    assert parser.feed("<tool_call>\n<function=ru").is_empty
    header = parser.feed("n>\n").tool_calls
    assert [(c.id, c.name, c.arguments) for c in header] == [("call_0", "run", ""), (None, None, "{")]
    assert _fragments(parser, "<parameter=command>\n") == '"command": "'
    assert _fragments(parser, 'echo "hi"\n') == 'echo \\"hi\\"'  # the final "\n" may end the value
    assert _fragments(parser, "done\n</para") == "\\ndone"
    assert _fragments(parser, "meter>\n<parameter=count>\n4") == '"'  # numbers go out whole
    assert _fragments(parser, "2\n</parameter>\n</function>") == ', "count": 42}'
    assert parser.finish().is_empty


_identifiers = st.text(alphabet=st.sampled_from("abcxyz_"), min_size=1, max_size=6)
# Raw string values: quotes, backslashes, newlines, unicode and "<" — but never a whole tag.
_raw_strings = st.lists(st.sampled_from(["a", " ", "\n", '"', "\\", "é", "😀", "<", "</", "/", ">", "\t"]), max_size=8)
_TYPED_VALUES: dict[str, st.SearchStrategy[tuple[Any, str]]] = {
    "string": _raw_strings.map("".join).map(lambda s: (s, s)),
    "integer": st.integers(min_value=-(10**15), max_value=10**15).map(lambda n: (n, str(n))),
    "number": st.floats(allow_nan=False, allow_infinity=False).map(lambda x: (x, json.dumps(x))),
    "boolean": st.sampled_from([(True, "true"), (False, "False"), (True, "TRUE")]),
    "array": st.lists(json_values, max_size=3).flatmap(lambda v: st.sampled_from([(v, json.dumps(v)), (v, repr(v))])),
    "object": st.dictionaries(st.text(max_size=3), json_values, max_size=3).map(lambda v: (v, json.dumps(v, indent=1))),
}


@st.composite
def _typed_call(draw: st.DrawFn, name_suffix: str) -> tuple[str, Call, dict[str, Any]]:
    """A call with one parameter of each drawn type (some nullable, some null), and its tool schema."""
    name = draw(_identifiers) + name_suffix  # one schema per function name
    parameter_names = draw(st.lists(_identifiers, unique=True, max_size=4))
    values: dict[str, Any] = {}
    properties: dict[str, Any] = {}
    body = ""
    for parameter_name in parameter_names:
        schema_type = draw(st.sampled_from(list(_TYPED_VALUES)))
        value, written = draw(_TYPED_VALUES[schema_type])
        if schema_type != "string" and draw(st.integers(min_value=0, max_value=5)) == 0:
            value, written = None, "null"
        properties[parameter_name] = {"type": [schema_type, "null"] if draw(st.booleans()) else schema_type}
        values[parameter_name] = value
        body += _parameter(parameter_name, written)
    return _call(name, body), Call(name, json.dumps(values)), _tool(name, properties)


@st.composite
def _model_output(draw: st.DrawFn) -> tuple[str, Message, list[dict[str, Any]]]:
    text, expected, tools, at_call_boundary = "", Message(), [], True
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        free = draw(free_text)
        if not (at_call_boundary and free.isspace()):
            expected.content += free
        text += free
        if draw(st.booleans()):
            call_text, call, tool = draw(_typed_call(str(len(tools))))
            text, at_call_boundary = text + call_text, True
            expected.tool_calls.append(call)
            tools.append(tool)
        else:
            block = "<tool_call>\n" + draw(free_text) + "\n</tool_call>"
            text, at_call_boundary = text + block, False
            expected.content += block
    free = draw(free_text)
    if not (at_call_boundary and free.isspace()):
        expected.content += free
    return text + free, expected, tools


@settings(max_examples=150, deadline=None)
@given(case=_model_output(), data=st.data())
def test_generated_output_gives_its_message_however_split(case: tuple[str, Message, Any], data: st.DataObject) -> None:
    text, expected, tools = case
    assert without_ids(parse_tools(Qwen3CoderToolParser, [text], tools)) == expected
    pieces = split_at(text, data.draw(cuts_for(text)))
    assert without_ids(parse_tools(Qwen3CoderToolParser, pieces, tools)) == expected


_TAG_FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=p>", "</parameter>", "\n"]


@st.composite
def _mangled_output(draw: st.DrawFn) -> tuple[str, list[dict[str, Any]]]:
    """Model output with tags and bits inserted and cut out, then stopped anywhere."""
    text, _, tools = draw(_model_output())
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=len(text)))
        if draw(st.booleans()):
            text = text[:at] + draw(st.sampled_from(_TAG_FRAGMENTS)) + text[at:]
        else:
            text = text[:at] + text[at + draw(st.integers(min_value=1, max_value=6)) :]
    return text[: draw(st.integers(min_value=0, max_value=len(text)))], tools


@settings(max_examples=200, deadline=None)
@given(case=_mangled_output(), data=st.data())
def test_any_text_cut_anywhere_agrees_with_whole_and_never_raises(
    case: tuple[str, list[dict[str, Any]]], data: st.DataObject
) -> None:
    text, tools = case
    whole = parse_tools(Qwen3CoderToolParser, [text], tools)  # also checks every call's arguments are JSON
    assert parse_tools(Qwen3CoderToolParser, split_at(text, data.draw(cuts_for(text))), tools) == whole
    assert parse_tools(Qwen3CoderToolParser, list(text), tools) == whole
