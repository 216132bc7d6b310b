"""Which JSON schemas admit a finite value: the check that turns an unsatisfiable recursive
schema into a 400 instead of an empty completion."""

from __future__ import annotations

from typing import Any

import pytest

from worker.structured.schema_finiteness import admits_finite_value

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}


@pytest.mark.parametrize(
    ("schema", "is_finite"),
    [
        ({"type": "string"}, True),
        ({"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}, False),
        ({"type": "object", "properties": {"child": {"$ref": "#"}}}, True),  # optional: may stop
        ({"type": "object", "properties": {"child": {"$ref": "#"}}, "required": []}, True),
        (
            {"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["c"]},
            True,
        ),
        ({"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#"}]}}, "required": ["c"]}, False),
        ({"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}, "required": ["c"]}, True),
        (
            {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
             "required": ["c"]},
            False,
        ),
        ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}, False),
        # Mutual recursion: a → b → a, with a way out only through b's nullable type.
        (
            {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                       "b": {"type": ["object", "null"], "properties": {"a": {"$ref": "#/$defs/a"}},
                             "required": ["a"]}},
             "$ref": "#/$defs/a"},
            True,
        ),
        ({"type": "object", "properties": {"x": False}, "required": ["x"]}, False),
        ({"$ref": "#/$defs/missing"}, True),  # left to the grammar engine to report
        ({"type": ["object", "string"], "properties": {"c": {"$ref": "#"}}, "required": ["c"]}, True),
        ({"allOf": [{"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}]}, False),
        ({"enum": [1, 2]}, True),
    ],
)  # fmt: skip
def test_admits_finite_value(schema: dict[str, Any], is_finite: bool) -> None:
    assert admits_finite_value(schema) is is_finite
