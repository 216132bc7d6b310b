"""response_format: every random walk through the grammar ends in JSON of the requested shape."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from shared.errors import ErrorKind, RelayError
from tests.worker.structured.conftest import TokenizerCase
from tests.worker.structured.random_walk import random_walk
from worker.structured import JsonObjectConstraint, JsonSchemaConstraint

SEEDS = range(4)

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "is_express": {"type": "boolean"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "maximum": 99}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["order_id", "status", "is_express", "customer", "items"],
    "additionalProperties": False,
}

# OpenAI strict style: everything required, no extra keys, shared definitions by $ref.
STRICT_SCHEMA: dict[str, Any] = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["start", "end"]},
        "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 4},
        "is_closed": {"type": "boolean"},
        "weight": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    },
    "required": ["label", "points", "is_closed", "weight"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_walks_end_in_a_json_object(tokenizer_case: TokenizerCase, seed: int) -> None:
    compiled = tokenizer_case.compiler.compile_constraint(JsonObjectConstraint())
    walk = random_walk(compiled, tokenizer_case.tokenizer, tokenizer_case.vocab_size, seed)
    assert walk.is_terminated, walk.text
    assert isinstance(json.loads(walk.text), dict)


@pytest.mark.parametrize("schema", [ORDER_SCHEMA, STRICT_SCHEMA], ids=["order", "strict_refs"])
@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_walks_validate(tokenizer_case: TokenizerCase, schema: dict[str, Any], seed: int) -> None:
    constraint = JsonSchemaConstraint(schema, is_strict=schema is STRICT_SCHEMA)
    compiled = tokenizer_case.compiler.compile_constraint(constraint)
    walk = random_walk(compiled, tokenizer_case.tokenizer, tokenizer_case.vocab_size, seed)
    assert walk.is_terminated, walk.text
    jsonschema.validate(json.loads(walk.text), schema)


def test_strict_schema_with_unenforceable_keyword_is_a_400(smollm2_case: TokenizerCase) -> None:
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "lunar-date"}}}
    with pytest.raises(RelayError) as raised:
        smollm2_case.compiler.compile_constraint(JsonSchemaConstraint(schema, is_strict=True))
    assert raised.value.kind is ErrorKind.INVALID_REQUEST
    assert raised.value.param == "response_format"
    assert "lunar-date" in raised.value.message


def test_non_strict_schema_ignores_unenforceable_keyword(smollm2_case: TokenizerCase) -> None:
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "lunar-date"}}}
    compiled = smollm2_case.compiler.compile_constraint(JsonSchemaConstraint(schema, is_strict=False))
    walk = random_walk(compiled, smollm2_case.tokenizer, smollm2_case.vocab_size, seed=0)
    assert walk.is_terminated
    assert isinstance(json.loads(walk.text), dict)


# Recursion with a way out (here a nullable link) is enforced as written. (A random walk through
# a branching recursion, such as a tree, rarely ends; a list does.)
LIST_SCHEMA: dict[str, Any] = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 4},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["name", "next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_strict_recursive_schema_is_enforced(smollm2_case: TokenizerCase, seed: int) -> None:
    compiled = smollm2_case.compiler.compile_constraint(JsonSchemaConstraint(LIST_SCHEMA, is_strict=True))
    walk = random_walk(compiled, smollm2_case.tokenizer, smollm2_case.vocab_size, seed)
    assert walk.is_terminated, walk.text
    jsonschema.validate(json.loads(walk.text), LIST_SCHEMA)


@pytest.mark.parametrize("is_strict", [True, False])
def test_a_schema_that_recurses_forever_is_a_400(smollm2_case: TokenizerCase, is_strict: bool) -> None:
    # Every value needs a `child`, which needs a `child`...: no finite JSON satisfies it.
    schema = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    with pytest.raises(RelayError) as raised:
        smollm2_case.compiler.compile_constraint(JsonSchemaConstraint(schema, is_strict=is_strict))
    assert raised.value.kind is ErrorKind.INVALID_REQUEST and raised.value.param == "response_format"
    assert "no finite value" in raised.value.message
