"""What a request asks the output to be, independent of any grammar library.

These are plain values: the request mapping builds them, the compiler turns them into grammars
and caches by :func:`constraint_key`, so two requests that ask the same thing share one grammar.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

ToolCallFormat = Literal["hermes", "qwen3_coder"]
TOOL_CALL_FORMATS: tuple[ToolCallFormat, ...] = ("hermes", "qwen3_coder")

# OpenAI: a function declared without ``parameters`` takes none, so its arguments are ``{}``.
NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class JsonObjectConstraint:
    """``response_format={"type": "json_object"}``: any JSON object."""

    request_param: ClassVar[str] = "response_format"


@dataclass(frozen=True)
class JsonSchemaConstraint:
    """``response_format={"type": "json_schema", ...}``: JSON that validates against ``schema``.

    ``is_strict`` (OpenAI's ``strict``) refuses schemas with keywords the grammar cannot enforce;
    otherwise such keywords are ignored and the output is best-effort for them.
    """

    schema: Mapping[str, Any]
    is_strict: bool = False
    request_param: ClassVar[str] = "response_format"


@dataclass(frozen=True)
class ToolSchema:
    """One callable function: its name and the JSON schema of its arguments."""

    name: str
    parameters: Mapping[str, Any]
    is_strict: bool = False


@dataclass(frozen=True)
class ToolCallConstraint:
    """A forced tool call in the model's native ``format``, to one of ``tools``.

    ``is_parallel`` allows several calls one after another; otherwise exactly one.
    """

    format: ToolCallFormat
    tools: tuple[ToolSchema, ...]
    is_parallel: bool = False
    request_param: ClassVar[str] = "tools"


Constraint = JsonObjectConstraint | JsonSchemaConstraint | ToolCallConstraint


def constraint_key(constraint: Constraint) -> str:
    """A string equal for constraints that compile to the same grammar.

    Keys are not sorted: property order is part of the grammar (properties are generated in
    schema order), so schemas that differ only in order must not share an entry.
    """
    match constraint:
        case JsonObjectConstraint():
            fields: dict[str, Any] = {}
        case JsonSchemaConstraint(schema=schema, is_strict=is_strict):
            fields = {"schema": schema, "strict": is_strict}
        case ToolCallConstraint(format=fmt, tools=tools, is_parallel=is_parallel):
            described = [{"name": t.name, "parameters": t.parameters, "strict": t.is_strict} for t in tools]
            fields = {"format": fmt, "tools": described, "parallel": is_parallel}
    return json.dumps({"kind": type(constraint).__name__, **fields}, ensure_ascii=False, separators=(",", ":"))
