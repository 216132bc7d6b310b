"""The per-tokenizer compiler: grammar text per format, the cache, and tokenizer checks."""

from __future__ import annotations

import copy

import pytest

from shared.errors import ErrorKind, RelayError
from tests.worker.structured.conftest import TokenizerCase
from worker.structured import ConstraintCompiler, JsonSchemaConstraint, ToolCallConstraint, ToolSchema

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
ADD = ToolSchema("add", {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})


def test_the_same_schema_compiles_once(smollm2_case: TokenizerCase) -> None:
    compiler = smollm2_case.compiler
    first = compiler.compile_constraint(JsonSchemaConstraint(SCHEMA))
    num_compiled, num_hits = compiler.num_compiled, compiler.num_cache_hits
    again = compiler.compile_constraint(JsonSchemaConstraint(copy.deepcopy(SCHEMA)))
    assert again is first
    assert (compiler.num_compiled, compiler.num_cache_hits) == (num_compiled, num_hits + 1)


def test_property_order_and_strictness_are_part_of_the_key(smollm2_case: TokenizerCase) -> None:
    compiler = smollm2_case.compiler
    first = compiler.compile_constraint(JsonSchemaConstraint(SCHEMA))
    reordered = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert compiler.compile_constraint(JsonSchemaConstraint(reordered)) is not first
    assert compiler.compile_constraint(JsonSchemaConstraint(SCHEMA, is_strict=True)) is not first


def test_least_recently_used_grammar_is_evicted(smollm2_case: TokenizerCase) -> None:
    compiler = ConstraintCompiler(smollm2_case.tokenizer, smollm2_case.vocab_size, [2], cache_size=2)
    schemas = [{"type": "object", "properties": {name: {"type": "integer"}}} for name in "abc"]
    first = compiler.compile_constraint(JsonSchemaConstraint(schemas[0]))
    compiler.compile_constraint(JsonSchemaConstraint(schemas[1]))
    assert compiler.compile_constraint(JsonSchemaConstraint(schemas[0])) is first  # now most recent
    compiler.compile_constraint(JsonSchemaConstraint(schemas[2]))  # evicts schemas[1]
    assert compiler.compile_constraint(JsonSchemaConstraint(schemas[0])) is first
    num_compiled = compiler.num_compiled
    compiler.compile_constraint(JsonSchemaConstraint(schemas[1]))
    assert compiler.num_compiled == num_compiled + 1


def test_tags_are_token_ids_only_where_they_are_single_tokens(
    smollm2_case: TokenizerCase, qwen_style_case: TokenizerCase
) -> None:
    constraint = ToolCallConstraint("hermes", (ADD,))
    assert '"<tool_call>"' in smollm2_case.compiler.grammar_text(constraint)
    open_id = qwen_style_case.tokenizer.convert_tokens_to_ids("<tool_call>")
    close_id = qwen_style_case.tokenizer.convert_tokens_to_ids("</tool_call>")
    qwen_grammar = qwen_style_case.compiler.grammar_text(constraint)
    assert f"<[{open_id}]>" in qwen_grammar
    assert f"<[{close_id}]>" in qwen_grammar
    assert '"<tool_call>"' not in qwen_grammar


def test_a_tool_with_an_uncompilable_strict_schema_is_a_400_on_tools(smollm2_case: TokenizerCase) -> None:
    tool = ToolSchema("f", {"type": "object", "properties": {"d": {"format": "nonsense"}}}, is_strict=True)
    with pytest.raises(RelayError) as raised:
        smollm2_case.compiler.compile_constraint(ToolCallConstraint("hermes", (tool,)))
    assert (raised.value.kind, raised.value.param) == (ErrorKind.INVALID_REQUEST, "tools")


def test_model_vocabulary_must_cover_the_tokenizer(smollm2_case: TokenizerCase) -> None:
    with pytest.raises(ValueError):
        ConstraintCompiler(smollm2_case.tokenizer, len(smollm2_case.tokenizer) - 1, [2])
    with pytest.raises(ValueError):
        ConstraintCompiler(smollm2_case.tokenizer, smollm2_case.vocab_size, [])
