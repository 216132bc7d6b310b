"""``response_format`` grammars: any JSON object, or JSON conforming to the client's schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.structured.lark_text import embedded_json

ANY_JSON_OBJECT: Mapping[str, Any] = {"type": "object"}


def json_object_grammar() -> str:
    return f"start: {embedded_json(ANY_JSON_OBJECT, is_strict=True)}\n"


def json_schema_grammar(schema: Mapping[str, Any], is_strict: bool) -> str:
    return f"start: {embedded_json(schema, is_strict)}\n"
