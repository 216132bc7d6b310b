"""Constraints → compiled grammars, once per model tokenizer, with a cache of recent grammars.

The expensive steps happen here and only once: the tokenizer's token trie (~0.3 s for 50k
tokens) when the worker starts, and each distinct grammar's construction (up to tens of ms for
large schemas) on first use. A sequence then starts from a copy of the compiled matcher.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import llguidance
import llguidance.hf

from shared.errors import ErrorKind, RelayError
from worker.structured.constraints import (
    Constraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ToolCallConstraint,
    constraint_key,
)
from worker.structured.hermes_grammar import hermes_grammar
from worker.structured.json_grammar import json_object_grammar, json_schema_grammar
from worker.structured.lark_text import TagTokens
from worker.structured.matcher import ConstraintMatcher
from worker.structured.qwen3_coder_grammar import qwen3_coder_grammar
from worker.structured.schema_finiteness import admits_finite_value

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class CompiledConstraint:
    """A grammar ready to constrain any number of sequences; immutable, shared between them."""

    grammar: str
    stop_token_ids: frozenset[int]
    _initial: llguidance.LLMatcher

    def new_matcher(self) -> ConstraintMatcher:
        return ConstraintMatcher(self._initial.deep_copy(), self.stop_token_ids)


class ConstraintCompiler:
    """One per loaded model: its tokenizer as the grammar library sees it, and the grammar cache.

    ``vocab_size`` is the model's logits width, which may exceed ``len(tokenizer)`` (padded
    embeddings); ``stop_token_ids`` are the only tokens allowed once the constrained text is
    complete. Safe to call from several threads.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("a constrained sequence needs at least one stop token id")
        self.tags = TagTokens.from_tokenizer(tokenizer)
        self._ll_tokenizer = llguidance.hf.from_tokenizer(  # it refuses all but fast tokenizers itself
            cast("PreTrainedTokenizerFast", tokenizer), n_vocab=vocab_size, eos_token=sorted(self.stop_token_ids)
        )
        self._cache: OrderedDict[str, CompiledConstraint] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_cache_hits = 0
        self.num_compiled = 0

    def compile_constraint(self, constraint: Constraint) -> CompiledConstraint:
        """The compiled grammar for ``constraint``, from the cache when it was compiled before.

        Raises ``RelayError(INVALID_REQUEST)`` when the schema cannot be compiled.
        """
        key = constraint_key(constraint)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return cached
        compiled = self._compile(constraint)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, constraint: Constraint) -> CompiledConstraint:
        _require_finite_values(constraint)
        grammar = self.grammar_text(constraint)
        # Construction drops the GIL, so compiling outside the lock lets other threads run.
        initial = llguidance.LLMatcher(self._ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if initial.is_error():
            message = initial.get_error().splitlines()[0]
            logger.info("constraint rejected: %s", message)
            raise RelayError(ErrorKind.INVALID_REQUEST, f"unsupported schema: {message}", constraint.request_param)
        return CompiledConstraint(grammar, self.stop_token_ids, initial)

    def grammar_text(self, constraint: Constraint) -> str:
        """The Lark grammar for ``constraint`` in this tokenizer (tags may be token ids)."""
        match constraint:
            case JsonObjectConstraint():
                return json_object_grammar()
            case JsonSchemaConstraint(schema=schema, is_strict=is_strict):
                return json_schema_grammar(schema, is_strict)
            case ToolCallConstraint(format="hermes", tools=tools, is_parallel=is_parallel):
                return hermes_grammar(tools, is_parallel, self.tags)
            case ToolCallConstraint(format="qwen3_coder", tools=tools, is_parallel=is_parallel):
                return qwen3_coder_grammar(tools, is_parallel, self.tags)
        raise ValueError(f"no grammar for {constraint!r}")


def _require_finite_values(constraint: Constraint) -> None:
    """400 for a schema no finite JSON satisfies (a required recursion without a way out): its
    grammar accepts nothing, and the model could only stop at once with empty content."""
    match constraint:
        case JsonSchemaConstraint(schema=schema):
            schemas = [("response_format", schema)]
        case ToolCallConstraint(tools=tools):
            schemas = [(f"tools ({tool.name})", tool.parameters) for tool in tools]
        case _:
            schemas = []
    for where, schema in schemas:
        if not admits_finite_value(schema):
            message = f"The JSON schema of {where} admits no finite value: a required property recurses forever."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, constraint.request_param)
