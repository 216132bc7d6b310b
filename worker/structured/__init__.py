"""Constrained decoding: the output of a request is forced to match a grammar, token by token.

``response_format`` (a JSON object, or JSON conforming to a schema) and forced tool calls (in the
model's native hermes or qwen3_coder format) become grammars through llguidance. Per model, one
:class:`ConstraintCompiler` holds the tokenizer's token trie and a grammar cache; per sequence,
a :class:`ConstraintMatcher` gives each step's allowed tokens as a bitmask, which
:func:`apply_token_bitmasks_` applies to a batch of logits.
"""

from worker.structured.bitmask import allocate_token_bitmask, apply_token_bitmasks_, fill_token_bitmasks
from worker.structured.compiler import CompiledConstraint, ConstraintCompiler
from worker.structured.constraints import (
    TOOL_CALL_FORMATS,
    Constraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ToolCallConstraint,
    ToolCallFormat,
    ToolSchema,
)
from worker.structured.from_request import constraint_from_request
from worker.structured.matcher import ConstraintMatcher

__all__ = [
    "TOOL_CALL_FORMATS",
    "CompiledConstraint",
    "Constraint",
    "ConstraintCompiler",
    "ConstraintMatcher",
    "JsonObjectConstraint",
    "JsonSchemaConstraint",
    "ToolCallConstraint",
    "ToolCallFormat",
    "ToolSchema",
    "allocate_token_bitmask",
    "apply_token_bitmasks_",
    "constraint_from_request",
    "fill_token_bitmasks",
]
