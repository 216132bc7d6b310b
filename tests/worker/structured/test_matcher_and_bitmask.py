"""Per-sequence matchers and batch masking: what is allowed when, and how it reaches the logits."""

from __future__ import annotations

import pytest
import torch

from tests.worker.structured.conftest import TokenizerCase
from tests.worker.structured.random_walk import allowed_token_ids, random_walk
from worker.structured import (
    ConstraintCompiler,
    JsonObjectConstraint,
    ToolCallConstraint,
    ToolSchema,
    allocate_token_bitmask,
    apply_token_bitmasks_,
    fill_token_bitmasks,
)

PING = ToolSchema("ping", {"type": "object", "properties": {"host": {"type": "string"}}, "required": ["host"]})


def test_after_the_constrained_text_only_the_stop_token_is_allowed(tokenizer_case: TokenizerCase) -> None:
    for constraint in (JsonObjectConstraint(), ToolCallConstraint("hermes", (PING,), is_parallel=False)):
        compiled = tokenizer_case.compiler.compile_constraint(constraint)
        walk = random_walk(compiled, tokenizer_case.tokenizer, tokenizer_case.vocab_size, seed=1)
        assert walk.token_ids[-1] == tokenizer_case.stop_token_id
        assert allowed_token_ids(walk.last_bitmask, tokenizer_case.vocab_size) == {tokenizer_case.stop_token_id}


def test_parallel_calls_may_go_on_or_stop_after_a_call(smollm2_case: TokenizerCase) -> None:
    compiled = smollm2_case.compiler.compile_constraint(ToolCallConstraint("hermes", (PING,), is_parallel=True))
    matcher = compiled.new_matcher()
    text = '<tool_call>\n{"name": "ping", "arguments": {"host": "a"}}\n</tool_call>'
    assert all(matcher.accept_token(t) for t in smollm2_case.tokenizer.encode(text, add_special_tokens=False))
    bitmask = allocate_token_bitmask(1, smollm2_case.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    newline = smollm2_case.tokenizer.encode("\n", add_special_tokens=False)
    assert allowed_token_ids(bitmask[0], smollm2_case.vocab_size) == {smollm2_case.stop_token_id, *newline}


def test_any_configured_stop_token_ends_the_text(smollm2_case: TokenizerCase) -> None:
    stop_token_ids = {smollm2_case.stop_token_id, 0}
    compiler = ConstraintCompiler(smollm2_case.tokenizer, smollm2_case.vocab_size, stop_token_ids)
    compiled = compiler.compile_constraint(JsonObjectConstraint())
    walk = random_walk(compiled, smollm2_case.tokenizer, smollm2_case.vocab_size, seed=0)
    assert allowed_token_ids(walk.last_bitmask, smollm2_case.vocab_size) == stop_token_ids


def test_terminated_matcher_accepts_nothing_more(smollm2_case: TokenizerCase) -> None:
    compiled = smollm2_case.compiler.compile_constraint(JsonObjectConstraint())
    matcher = compiled.new_matcher()
    for token in [*smollm2_case.tokenizer.encode("{}", add_special_tokens=False), smollm2_case.stop_token_id]:
        assert not matcher.is_terminated
        assert matcher.accept_token(token)
    assert matcher.is_terminated
    assert not matcher.accept_token(smollm2_case.stop_token_id)


def test_a_forbidden_token_is_refused_and_leaves_an_error(smollm2_case: TokenizerCase) -> None:
    matcher = smollm2_case.compiler.compile_constraint(JsonObjectConstraint()).new_matcher()
    assert not matcher.accept_token(smollm2_case.tokenizer.encode("[", add_special_tokens=False)[0])
    assert matcher.is_error
    assert matcher.error_message


def test_stop_token_is_not_allowed_before_the_text_is_complete(smollm2_case: TokenizerCase) -> None:
    matcher = smollm2_case.compiler.compile_constraint(JsonObjectConstraint()).new_matcher()
    assert matcher.accept_token(smollm2_case.tokenizer.encode("{", add_special_tokens=False)[0])
    bitmask = allocate_token_bitmask(1, smollm2_case.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert smollm2_case.stop_token_id not in allowed_token_ids(bitmask[0], smollm2_case.vocab_size)


def test_padding_tokens_beyond_the_tokenizer_are_never_allowed(smollm2_case: TokenizerCase) -> None:
    compiled = smollm2_case.compiler.compile_constraint(ToolCallConstraint("qwen3_coder", (PING,)))
    matcher = compiled.new_matcher()
    prefix = "<tool_call>\n<function=ping>\n<parameter=host>\n"
    assert all(matcher.accept_token(t) for t in smollm2_case.tokenizer.encode(prefix, add_special_tokens=False))
    bitmask = allocate_token_bitmask(1, smollm2_case.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = allowed_token_ids(bitmask[0], smollm2_case.vocab_size)
    assert len(allowed) > len(smollm2_case.tokenizer) // 2  # free text: most of the vocabulary
    assert max(allowed) < len(smollm2_case.tokenizer)


def test_fill_refuses_a_bitmask_of_the_wrong_kind(smollm2_case: TokenizerCase) -> None:
    matcher = smollm2_case.compiler.compile_constraint(JsonObjectConstraint()).new_matcher()
    with pytest.raises(ValueError):
        matcher.fill_next_token_bitmask(allocate_token_bitmask(1, smollm2_case.vocab_size).long(), 0)
    with pytest.raises(ValueError):
        matcher.fill_next_token_bitmask(allocate_token_bitmask(1, smollm2_case.vocab_size // 2), 0)


def test_fill_token_bitmasks_writes_only_rows_with_a_matcher(smollm2_case: TokenizerCase) -> None:
    compiled = smollm2_case.compiler.compile_constraint(JsonObjectConstraint())
    bitmask = allocate_token_bitmask(3, smollm2_case.vocab_size)
    fill_token_bitmasks(bitmask, {0: compiled.new_matcher(), 2: compiled.new_matcher()})
    open_brace = smollm2_case.tokenizer.encode("{", add_special_tokens=False)[0]
    assert open_brace in allowed_token_ids(bitmask[0], smollm2_case.vocab_size)
    assert torch.equal(bitmask[0], bitmask[2])
    assert bool((bitmask[1] == -1).all())


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    expected = logits.clone()
    for row in rows:
        for token in range(logits.shape[1]):
            word, bit = divmod(token, 32)
            if word >= bitmask.shape[1] or not (int(bitmask[row, word]) >> bit) & 1:
                expected[row, token] = float("-inf")
    return expected


@pytest.mark.parametrize("vocab_size", [64, 70, 100])
def test_apply_masks_only_the_given_rows(vocab_size: int) -> None:
    """Widths: a whole number of words, a partial last word, and logits wider than the bitmask."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 3), dtype=torch.int32, generator=generator)[:, : (70 + 31) // 32]
    logits = torch.randn(4, vocab_size, generator=generator)
    rows = [0, 2, 3]
    expected = reference_mask(logits, bitmask, rows)
    apply_token_bitmasks_(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_apply_with_no_rows_changes_nothing() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_token_bitmasks_(logits, torch.zeros(2, 2, dtype=torch.int32), [])
    assert torch.equal(logits, before)
