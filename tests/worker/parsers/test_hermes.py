"""Hermes tool calls (Qwen2.5 / Qwen3): tables, streaming behaviour, and any split agreeing with the whole."""

from __future__ import annotations

import json

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
from worker.parsers.hermes import HermesToolParser


def _block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = _block('{"name": "get_weather", "arguments": {"city": "Beijing"}}')
TIME = _block('{"name": "get_time", "arguments": {"tz": "UTC+8", "verbose": true}}')

CASES: dict[str, tuple[str, Message]] = {
    "plain text": ("Hello <b>world</b> {}", Message(content="Hello <b>world</b> {}")),
    "one call": (WEATHER, Message(tool_calls=[Call("get_weather", '{"city": "Beijing"}')])),
    "text then a call": (
        "Let me check.\n\n" + WEATHER,
        Message(content="Let me check.\n\n", tool_calls=[Call("get_weather", '{"city": "Beijing"}')]),
    ),
    "several calls, blanks between them are layout": (
        WEATHER + "\n" + TIME + "\n",
        Message(
            tool_calls=[
                Call("get_weather", '{"city": "Beijing"}'),
                Call("get_time", '{"tz": "UTC+8", "verbose": true}'),
            ]
        ),
    ),
    "text after a call is content": (
        WEATHER + "\nDone.",
        Message(content="\nDone.", tool_calls=[Call("get_weather", '{"city": "Beijing"}')]),
    ),
    "arguments before name": (
        _block('{"arguments": {"q": [1, {"x": null}]}, "name": "search"}'),
        Message(tool_calls=[Call("search", '{"q": [1, {"x": null}]}')]),
    ),
    "arguments as written: layout, escapes, unicode": (
        _block('{"name":"f","arguments":{\n  "s": "a \\"q\\" \\\\ \\u00e9 é 😀\\n",\n  "n": -1.5e3\n}}'),
        Message(tool_calls=[Call("f", '{\n  "s": "a \\"q\\" \\\\ \\u00e9 é 😀\\n",\n  "n": -1.5e3\n}')]),
    ),
    "other keys are ignored": (
        _block('{"type": "function", "name": "f", "id": {"a": [1]}, "arguments": {}}'),
        Message(tool_calls=[Call("f", "{}")]),
    ),
    "no arguments": (_block('{"name": "now"}'), Message(tool_calls=[Call("now", "{}")])),
    "escaped name": (_block('{"name": "caf\\u00e9", "arguments": {}}'), Message(tool_calls=[Call("café", "{}")])),
    "missing closing tag": (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',
        Message(tool_calls=[Call("f", '{"a": 1}')]),
    ),
    "cut off inside a string": (
        '<tool_call>\n{"name": "f", "arguments": {"a": "x\\u00',
        Message(tool_calls=[Call("f", '{"a": "x"}')]),
    ),
    "cut off after a comma and half a key": (
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2.], "b',
        Message(tool_calls=[Call("f", '{"a": [1, 2.0]}')]),
    ),
    "closing tag while the arguments are open": (
        '<tool_call>\n{"name": "f", "arguments": {"a": {"b": tr</tool_call>after',
        Message(content="after", tool_calls=[Call("f", '{"a": {"b": true}}')]),
    ),
    "not json falls back to content": (_block("not json"), Message(content=_block("not json"))),
    "name not a string falls back to content": (
        _block('{"name": 5, "arguments": {}}'),
        Message(content=_block('{"name": 5, "arguments": {}}')),
    ),
    "no name before the closing tag falls back to content": (
        "Hi " + _block('{"arguments": {"a": 1}'),
        Message(content="Hi " + _block('{"arguments": {"a": 1}')),
    ),
    "no name before the end falls back to content": (
        '<tool_call>{"arguments": {"a": 1}, "na',
        Message(content='<tool_call>{"arguments": {"a": 1}, "na'),
    ),
    "malformed block then a good one": (
        _block("oops") + WEATHER,
        Message(content=_block("oops"), tool_calls=[Call("get_weather", '{"city": "Beijing"}')]),
    ),
    "garbage after the call object is dropped": (
        _block('{"name": "f", "arguments": {"a": 1}} trailing'),
        Message(tool_calls=[Call("f", '{"a": 1}')]),
    ),
    "bad json inside the arguments ends them": (
        _block('{"name": "f", "arguments": {"a": 1 "b": 2}}'),
        Message(tool_calls=[Call("f", '{"a": 1}')]),
    ),
    "raw control characters and bad escapes are repaired": (
        _block('{"name": "f", "arguments": {"code": "a\tb\\x"}}'),
        Message(tool_calls=[Call("f", '{"code": "a\\tb\\\\x"}')]),
    ),
    "half an opening tag at the end is content": ("See <tool_ca", Message(content="See <tool_ca")),
    "a stray closing tag is content": ("a </tool_call> b", Message(content="a </tool_call> b")),
    "only blanks": ("\n\n", Message()),
}


@pytest.mark.parametrize("text, expected", CASES.values(), ids=CASES.keys())
def test_table_whole_and_split_every_way(text: str, expected: Message) -> None:
    for pieces in every_way_to_split(text):
        assert without_ids(parse_tools(HermesToolParser, pieces)) == expected, pieces


def _tool(name: str) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


OFFERED = [_tool("get_weather"), _tool("get_time"), _tool("f")]
FENCED_WEATHER = '```json\n{"name": "get_weather", "arguments": {"city": "Beijing"}}\n```'
# Qwen2.5-Coder often writes the call as a fenced JSON object instead of the tags.
LEAD_CASES: dict[str, tuple[str, Message]] = {
    "a fenced call first": (FENCED_WEATHER, Message(tool_calls=[Call("get_weather", '{"city": "Beijing"}')])),
    "blanks before it are layout": (
        "\n " + FENCED_WEATHER + "\n",
        Message(tool_calls=[Call("get_weather", '{"city": "Beijing"}')]),
    ),
    "then a tagged call": (
        FENCED_WEATHER + "\n" + TIME,
        Message(
            tool_calls=[
                Call("get_weather", '{"city": "Beijing"}'),
                Call("get_time", '{"tz": "UTC+8", "verbose": true}'),
            ]
        ),
    ),
    "fences inside the arguments do not close it": (
        '```json\n{"name": "f", "arguments": {"code": "```py\\nx\\n```"}}\n```',
        Message(tool_calls=[Call("f", '{"code": "```py\\nx\\n```"}')]),
    ),
    "no closing fence": ('```json\n{"name": "f", "arguments": {"a": 1}}', Message(tool_calls=[Call("f", '{"a": 1}')])),
    "a tool not offered is content": (
        '```json\n{"name": "rm_rf", "arguments": {}}\n```',
        Message(content='```json\n{"name": "rm_rf", "arguments": {}}\n```'),
    ),
    "JSON that is no call is content": (
        '```json\n{"answer": 42}\n```',
        Message(content='```json\n{"answer": 42}\n```'),
    ),
    "a fence after text is content": ("Sure:\n" + FENCED_WEATHER, Message(content="Sure:\n" + FENCED_WEATHER)),
    "a fence after a call is content": (
        WEATHER + FENCED_WEATHER,
        Message(content=FENCED_WEATHER, tool_calls=[Call("get_weather", '{"city": "Beijing"}')]),
    ),
    "another language is content": ("```python\nprint(1)\n```", Message(content="```python\nprint(1)\n```")),
    "half a fence at the end is content": ("``", Message(content="``")),
}


@pytest.mark.parametrize("text, expected", LEAD_CASES.values(), ids=LEAD_CASES.keys())
def test_a_fenced_json_call_first_is_a_call_when_it_names_an_offered_tool(text: str, expected: Message) -> None:
    for pieces in every_way_to_split(text):
        assert without_ids(parse_tools(HermesToolParser, pieces, OFFERED)) == expected, pieces


def test_registered_by_name() -> None:
    assert tool_parser_class("hermes") is HermesToolParser


def test_header_as_soon_as_the_name_is_known_and_arguments_started() -> None:
    parser = HermesToolParser([], new_call_id=sequential_ids())
    assert parser.feed('Sure.<tool_call>\n{"name": "get_weather"').tool_calls == []
    assert parser.num_tool_calls == 0
    delta = parser.feed(', "arguments": {"ci')
    assert [(c.index, c.id, c.name, c.arguments) for c in delta.tool_calls] == [
        (0, "call_0", "get_weather", ""),
        (0, None, None, "{"),  # the key is held until its value starts
    ]
    assert parser.num_tool_calls == 1


def test_arguments_stream_as_written() -> None:
    parser = HermesToolParser([], new_call_id=sequential_ids())
    pieces = ['<tool_call>\n{"name": "f", "arguments": {"city": "Bei', "jing", '"}}\n</tool', "_call>"]
    fragments = [[c.arguments for c in parser.feed(piece).tool_calls] for piece in pieces]
    assert fragments == [["", '{"city": "Bei'], ["jing"], ['"}'], []]
    assert parser.finish().is_empty


def test_partial_tag_is_never_content() -> None:
    parser = HermesToolParser([], new_call_id=sequential_ids())
    assert parser.feed("Hi <tool").content == "Hi "
    assert parser.feed("_ca").content == ""
    assert parser.feed("ll>").content == ""


def test_buffered_arguments_go_out_when_the_name_comes() -> None:
    parser = HermesToolParser([], new_call_id=sequential_ids())
    assert parser.feed('<tool_call>{"arguments": {"a": [1, 2]}').tool_calls == []
    delta = parser.feed(', "name": "f"}')
    assert [(c.name, c.arguments) for c in delta.tool_calls] == [("f", ""), (None, '{"a": [1, 2]}')]


_names = st.text(alphabet=st.sampled_from('abc_é😀"\\'), min_size=1, max_size=6)


@st.composite
def _call_text(draw: st.DrawFn) -> tuple[str, Call]:
    """A well-formed call, its JSON laid out in one of the ways models write it."""
    name = draw(_names)
    arguments = json.dumps(
        draw(st.dictionaries(st.text(max_size=4), json_values, max_size=4)),
        ensure_ascii=draw(st.booleans()),
        indent=draw(st.sampled_from([None, 2])),
    )
    members = [f'"name": {json.dumps(name)}', f'"arguments": {arguments}']
    if draw(st.booleans()):
        members.reverse()
    layout = draw(st.sampled_from([("{", ", ", "}"), ("{ ", ",\n ", " }")]))
    return _block(layout[0] + layout[1].join(members) + layout[2]), Call(name, arguments)


_malformed_block = st.sampled_from(
    ["not json", "{}", '{"name": 5, "arguments": {}}', '{"arguments": {"a": 1}}', "[1]", '{"name" "f"}']
).map(_block) | free_text.map(_block)


@st.composite
def _model_output(draw: st.DrawFn) -> tuple[str, Message]:
    """Free text, calls and malformed blocks in turn, with the message they must give."""
    text, expected, at_call_boundary = "", Message(), True
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        free = draw(free_text)
        # Blanks between calls (or before the first, or after the last) are layout, not content.
        if not (at_call_boundary and free.isspace()):
            expected.content += free
        text += free
        if draw(st.booleans()):
            call_text, call = draw(_call_text())
            text, at_call_boundary = text + call_text, True
            expected.tool_calls.append(call)
        else:
            block = draw(_malformed_block)
            text, at_call_boundary = text + block, False
            expected.content += block
    free = draw(free_text)
    if not (at_call_boundary and free.isspace()):
        expected.content += free
    return text + free, expected


@settings(max_examples=150, deadline=None)
@given(case=_model_output(), data=st.data())
def test_generated_output_gives_its_message_however_split(case: tuple[str, Message], data: st.DataObject) -> None:
    text, expected = case
    assert without_ids(parse_tools(HermesToolParser, [text])) == expected
    assert without_ids(parse_tools(HermesToolParser, split_at(text, data.draw(cuts_for(text))))) == expected


_JSON_FRAGMENTS = ["{", "}", "[", "]", '"', ":", ",", "\\", "\\u", "0", "1e", "-", ".", "tr", "null", " ", "\n", "é"]
_TAG_FRAGMENTS = ['"name": "f"', '"arguments"', "<tool_call>", "</tool_call>", "</tool", "```json", "\n```", "``"]


@st.composite
def _mangled_output(draw: st.DrawFn) -> str:
    """Model output with bits inserted and cut out: calls that break half-way, blocks that never close."""
    text = draw(_model_output())[0]
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=len(text)))
        if draw(st.booleans()):
            text = text[:at] + draw(st.sampled_from(_JSON_FRAGMENTS + _TAG_FRAGMENTS)) + text[at:]
        else:
            text = text[:at] + text[at + draw(st.integers(min_value=1, max_value=4)) :]
    return text


_jsonish_text = st.lists(st.sampled_from(_JSON_FRAGMENTS + _TAG_FRAGMENTS), max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(_mangled_output(), _jsonish_text), data=st.data())
def test_any_text_cut_anywhere_agrees_with_whole_and_never_raises(text: str, data: st.DataObject) -> None:
    text = text[: data.draw(st.integers(min_value=0, max_value=len(text)))]  # generation may stop anywhere
    whole = parse_tools(HermesToolParser, [text], OFFERED)  # also checks every call's arguments are JSON
    assert parse_tools(HermesToolParser, split_at(text, data.draw(cuts_for(text))), OFFERED) == whole
    assert parse_tools(HermesToolParser, list(text), OFFERED) == whole
