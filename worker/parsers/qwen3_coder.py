"""Qwen3-Coder tool calls: XML-ish tags with raw-text parameter values.

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

The arguments go out as the JSON object ``json.dumps`` would write for the typed values: ``{`` with
the header, string values char by char as the model writes them (clients show them live), other
values whole when their parameter closes, ``}`` at ``</function>``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.events import ToolCallDelta
from worker.parsers.base import register_tool_parser
from worker.parsers.tool_call_blocks import CallReader, ToolCallBlockParser, split_at_first_tag

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
_BETWEEN_PARAMETERS_TAGS = (PARAMETER_OPEN, FUNCTION_CLOSE)
# A value also ends where the next parameter or the function starts if the model left out </parameter>.
_VALUE_END_TAGS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE)
_INTEGER = re.compile(r"-?\d+")


def _to_integer(text: str) -> int:
    if not _INTEGER.fullmatch(text):
        raise ValueError(text)
    return int(text)


def _to_number(text: str) -> int | float:
    return int(text) if _INTEGER.fullmatch(text) else float(text)


def _to_boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


def _to_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ast.literal_eval(text)  # models sometimes write Python literals: single quotes, True


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _to_integer,
    "number": _to_number,
    "boolean": _to_boolean,
    "array": _to_json,
    "object": _to_json,
}


def typed_value(text: str, schema_type: str) -> Any:
    """A parameter's raw text as its JSON-schema type says; text that does not convert stays a string."""
    if schema_type not in _CONVERTERS:
        return text
    stripped = text.strip()
    if stripped.lower() == "null":
        return None
    try:
        value = _CONVERTERS[schema_type](stripped)
        json.dumps(value, allow_nan=False)  # NaN, sets, bytes… cannot go out as JSON
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    return value


def parameter_types(tools: list[dict[str, Any]], function_name: str) -> dict[str, str]:
    """Each parameter's JSON-schema type ("string" when unstated); nullable types count as the other one."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == function_name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {name: _schema_type(schema) for name, schema in properties.items() if isinstance(schema, dict)}
    return {}


def _schema_type(schema: dict[str, Any]) -> str:
    declared = schema.get("type", "string")
    if isinstance(declared, list):
        declared = next((name for name in declared if name != "null"), "string")
    return declared if isinstance(declared, str) else "string"


def _strip_final_newline(text: str) -> str:
    return text.removesuffix("\n")


@dataclass
class _OpenParameter:
    name: str
    schema_type: str
    raw_value: str = ""  # non-string values are typed whole, once the parameter closes
    is_value_started: bool = False  # its first char has been seen (a leading "\n" is layout)

    @property
    def is_streamed(self) -> bool:
        return self.schema_type not in _CONVERTERS


class Qwen3CoderCallReader(CallReader):
    def __init__(self, index: int, new_call_id: Callable[[], str], tools: list[dict[str, Any]]) -> None:
        super().__init__(index, new_call_id)
        self._tools = tools
        self._pending = ""  # text not yet decided on: part of a tag, a possibly final "\n"
        self._read = self._read_function  # reads from _pending; False when it has to wait for more text
        self._parameter_types: dict[str, str] = {}
        self._parameter: _OpenParameter | None = None
        self._num_parameters = 0
        self._is_function_closed = False
        self._unsent_deltas: list[ToolCallDelta] = []
        self._unsent_arguments = ""

    def feed(self, text: str) -> list[ToolCallDelta]:
        self._pending += text
        while not self.is_malformed and self._read():
            pass
        return self._flush()

    def close(self) -> list[ToolCallDelta]:
        if not self.has_call:
            self.is_malformed = True
            return []
        if self._parameter is not None:
            self._add_value_text(_strip_final_newline(self._pending))
            self._close_parameter()
        if not self._is_function_closed:
            self._close_function()
        return self._flush()

    def _flush(self) -> list[ToolCallDelta]:
        deltas = self._unsent_deltas + self._argument_deltas(self._unsent_arguments)
        self._unsent_deltas, self._unsent_arguments = [], ""
        return deltas

    def _read_function(self) -> bool:
        opening = self._pending.lstrip()
        if not opening.startswith(FUNCTION_OPEN):
            self.is_malformed = not FUNCTION_OPEN.startswith(opening)
            return False
        name, found, rest = opening[len(FUNCTION_OPEN) :].partition(">")
        if "<" in name or "\n" in name:
            self.is_malformed = True  # the ">" never came: this is not a function tag
            return False
        if not found:
            return False
        self._pending = rest
        self._unsent_deltas.append(self._header(name.strip()))
        self._unsent_arguments += "{"
        self._parameter_types = parameter_types(self._tools, name.strip())
        self._read = self._read_between_parameters
        return True

    def _read_between_parameters(self) -> bool:
        _, tag, self._pending = split_at_first_tag(self._pending, _BETWEEN_PARAMETERS_TAGS)
        if tag == FUNCTION_CLOSE:
            self._close_function()
        elif tag == PARAMETER_OPEN:
            self._read = self._read_parameter_name
        return bool(tag)

    def _read_parameter_name(self) -> bool:
        name, found, rest = self._pending.partition(">")
        if not found:
            return False
        self._pending = rest
        self._open_parameter(name.strip())
        return True

    def _read_value(self) -> bool:
        assert self._parameter is not None
        if not self._parameter.is_value_started:
            if not self._pending:
                return False
            self._parameter.is_value_started = True
            self._pending = self._pending.removeprefix("\n")
        text, tag, rest = split_at_first_tag(self._pending, _VALUE_END_TAGS)
        if not tag:
            held_newline = text[-1:] == "\n"  # the "\n" before a closing tag is layout
            self._add_value_text(_strip_final_newline(text))
            self._pending = "\n" * held_newline + rest
            return False
        self._add_value_text(_strip_final_newline(text))
        self._pending = rest if tag == PARAMETER_CLOSE else tag + rest
        self._close_parameter()
        return True

    def _skip_rest(self) -> bool:
        self._pending = ""
        return False

    def _open_parameter(self, name: str) -> None:
        self._parameter = _OpenParameter(name, self._parameter_types.get(name, "string"))
        if self._parameter.is_streamed:
            self._unsent_arguments += self._key_prefix(name) + '"'
        self._read = self._read_value

    def _add_value_text(self, text: str) -> None:
        assert self._parameter is not None
        if self._parameter.is_streamed:
            self._unsent_arguments += json.dumps(text)[1:-1]
        else:
            self._parameter.raw_value += text

    def _close_parameter(self) -> None:
        parameter, self._parameter = self._parameter, None
        assert parameter is not None
        if parameter.is_streamed:
            self._unsent_arguments += '"'
        else:
            value = typed_value(parameter.raw_value, parameter.schema_type)
            self._unsent_arguments += self._key_prefix(parameter.name) + json.dumps(value)
        self._read = self._read_between_parameters

    def _key_prefix(self, name: str) -> str:
        separator = ", " if self._num_parameters else ""
        self._num_parameters += 1
        return f"{separator}{json.dumps(name)}: "

    def _close_function(self) -> None:
        self._unsent_arguments += "}"
        self._is_function_closed = True
        self._read = self._skip_rest


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolCallBlockParser):
    def _new_reader(self, index: int, allowed_names: frozenset[str] | None = None) -> CallReader:
        return Qwen3CoderCallReader(index, self.new_call_id, self.tools)
