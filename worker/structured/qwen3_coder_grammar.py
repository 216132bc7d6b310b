"""Forced tool calls in Qwen3-Coder's XML-parameter format.

One call is ``<tool_call>\\n<function=NAME>\\n`` then, per parameter,
``<parameter=P>\\nVALUE\\n</parameter>\\n``, then ``</function>\\n</tool_call>``; parallel calls
are separated by ``\\n``. Required parameters are always present, optional ones may be, all in
schema order. Parsers keep a string value as raw text and convert any other value from JSON by
the parameter's schema type, so a string value is free text and every other value is JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.structured.constraints import ToolSchema
from worker.structured.lark_text import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TagTokens, embedded_json, literal

PARAMETER_CLOSE = "\n</parameter>\n"

# Free text may not contain the markup parsers split on (a value is also cut at the next
# ``<parameter=`` or ``</function>``), or the call would parse differently from how it was made.
# The closing tag is part of the same terminal, so the lexer never has to guess where text ends.
_TEXT_VALUE_TERMINALS = [
    'TEXT_VALUE: TEXT_BODY "\\n</parameter>\\n"',
    r"TEXT_BODY: /(?s:.*)/ & ~/(?s:.*)(<\/parameter>|<parameter=|<\/function>)(?s:.*)/",
]

# Keywords that give a schema without ``type`` a shape, so its value cannot be plain text.
_SHAPE_KEYWORDS = ("properties", "items", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")
_DEFINITION_KEYWORDS = ("$defs", "definitions")


def qwen3_coder_grammar(tools: tuple[ToolSchema, ...], is_parallel: bool, tags: TagTokens) -> str:
    repeat = ' ("\\n" tool_call)*' if is_parallel else ""
    functions = " | ".join(f"function_{index}" for index in range(len(tools)))
    open_tag, close_tag = tags.render(TOOL_CALL_OPEN), tags.render(TOOL_CALL_CLOSE)
    lines = [
        f"start: tool_call{repeat}",
        f'tool_call: {open_tag} "\\n" ({functions}) "</function>\\n" {close_tag}',
    ]
    for index, tool in enumerate(tools):
        lines += _function_rules(index, tool)
    return "\n".join(lines + _TEXT_VALUE_TERMINALS) + "\n"


def _function_rules(index: int, tool: ToolSchema) -> list[str]:
    header = literal(f"<function={tool.name}>\n")
    items, rules = [], []
    for position, (name, schema, is_required) in enumerate(_parameters(tool.parameters)):
        rule = f"parameter_{index}_{position}"
        items.append(rule if is_required else f"{rule}?")
        rules += _parameter_rules(rule, name, _with_definitions(schema, tool.parameters), tool.is_strict)
    return [f"function_{index}: {' '.join([header, *items])}", *rules]


def _parameter_rules(rule: str, name: str, schema: Mapping[str, Any], is_strict: bool) -> list[str]:
    opening = literal(f"<parameter={name}>\n")
    if _is_free_text(schema):
        return [f"{rule}: {opening} TEXT_VALUE"]
    choices = _string_choices(schema)
    if choices is not None:
        alternatives = " | ".join(literal(choice) for choice in choices)
        return [f"{rule}: {opening} ({alternatives}) {literal(PARAMETER_CLOSE)}"]
    return [
        f"{rule}: {opening} {rule}_json {literal(PARAMETER_CLOSE)}",
        f"{rule}_json: {embedded_json(schema, is_strict)}",
    ]


def _parameters(schema: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], bool]]:
    """(name, schema, is_required) in schema order; required names missing from properties last."""
    properties: Mapping[str, Any] = schema.get("properties") or {}
    required = list(schema.get("required") or [])
    names = list(properties) + [name for name in required if name not in properties]
    return [(name, properties.get(name) or {}, name in required) for name in names]


def _with_definitions(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """A parameter's schema compiles on its own, so ``#/$defs/...`` refs need the root's definitions."""
    definitions = {key: root[key] for key in _DEFINITION_KEYWORDS if key in root and key not in schema}
    return {**schema, **definitions}


def _is_free_text(schema: Mapping[str, Any]) -> bool:
    declared = schema.get("type")
    if declared is None:
        return not any(keyword in schema for keyword in _SHAPE_KEYWORDS)
    types = declared if isinstance(declared, list) else [declared]
    return "string" in types and _string_choices(schema) is None


def _string_choices(schema: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The raw texts an enum/const string parameter may take, or None if it is not one."""
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is None or not all(isinstance(value, str) for value in values):
        return None
    return tuple(values)
