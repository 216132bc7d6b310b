"""Per-step cost of constrained decoding on CPU, for a ~50k and a ~150k vocabulary.

The 50k one is SmolLM2's tokenizer. No 150k tokenizer ships with the tests, so the large one is
SmolLM2's plus ~103k tokens made by joining two of its tokens (the shape of real BPE merges),
for 151,936 in all, Qwen3's size. Not a test (pytest does not collect it); run with
``python -m tests.worker.structured.bench_mask_fill``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tests.support.models import default_model_dir
from tests.worker.structured.random_walk import random_walk
from tests.worker.structured.test_json_constraints import ORDER_SCHEMA
from tests.worker.structured.test_tool_call_constraints import TOOLS
from worker.structured import (
    ConstraintCompiler,
    ConstraintMatcher,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ToolCallConstraint,
    allocate_token_bitmask,
    apply_token_bitmasks_,
)
from worker.structured.constraints import Constraint

QWEN3_VOCAB_SIZE = 151_936
NUM_WALKS = 5
CONSTRAINTS: dict[str, Constraint] = {
    "json_object": JsonObjectConstraint(),
    "json_schema": JsonSchemaConstraint(ORDER_SCHEMA),
    "hermes": ToolCallConstraint("hermes", TOOLS, is_parallel=True),
    "qwen3_coder": ToolCallConstraint("qwen3_coder", TOOLS, is_parallel=True),
}


def widened_tokenizer(base: PreTrainedTokenizerBase, vocab_size: int) -> PreTrainedTokenizerBase:
    spec = json.loads(base.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {token["content"] for token in spec["added_tokens"]}
    pieces = [piece for piece in vocab if piece not in special]
    chooser = random.Random(0)
    while len(vocab) < vocab_size:
        vocab.setdefault(chooser.choice(pieces) + chooser.choice(pieces), len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=base.eos_token)


def timed_fills(samples_us: list[float]) -> Callable[..., None]:
    original = ConstraintMatcher.fill_next_token_bitmask

    def fill(self: ConstraintMatcher, bitmask: torch.Tensor, row: int) -> None:
        started = time.perf_counter()
        original(self, bitmask, row)
        samples_us.append((time.perf_counter() - started) * 1e6)

    return fill


def bench_vocabulary(label: str, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    started = time.perf_counter()
    compiler = ConstraintCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    print(f"\n{label}: vocab {vocab_size}, tokenizer prepared in {time.perf_counter() - started:.2f} s")
    original = ConstraintMatcher.fill_next_token_bitmask
    for name, constraint in CONSTRAINTS.items():
        started = time.perf_counter()
        compiled = compiler.compile_constraint(constraint)
        compile_ms = (time.perf_counter() - started) * 1e3
        samples_us: list[float] = []
        ConstraintMatcher.fill_next_token_bitmask = timed_fills(samples_us)  # type: ignore[method-assign]
        try:
            for seed in range(NUM_WALKS):
                random_walk(compiled, tokenizer, vocab_size, seed)
        finally:
            ConstraintMatcher.fill_next_token_bitmask = original  # type: ignore[method-assign]
        samples_us.sort()
        print(
            f"  {name:12s} compile {compile_ms:6.1f} ms | fill over {len(samples_us)} steps: "
            f"median {statistics.median(samples_us):6.0f} µs, p90 {samples_us[int(0.9 * len(samples_us))]:6.0f} µs, "
            f"mean {statistics.fmean(samples_us):6.0f} µs"
        )
    print(f"  apply, per row: {_apply_us(vocab_size):.0f} µs (best of 50, 8 rows)")


def _apply_us(vocab_size: int, num_rows: int = 8) -> float:
    bitmask = allocate_token_bitmask(num_rows, vocab_size).random_(-(2**31), 2**31 - 1)
    logits = torch.randn(num_rows, vocab_size)
    best_s = float("inf")
    for _ in range(50):
        started = time.perf_counter()
        apply_token_bitmasks_(logits, bitmask, list(range(num_rows)))
        best_s = min(best_s, time.perf_counter() - started)
    return best_s * 1e6 / num_rows


def main() -> None:
    model_dir: Path = default_model_dir()
    base = AutoTokenizer.from_pretrained(model_dir)
    print(f"torch threads: {torch.get_num_threads()}")
    bench_vocabulary("SmolLM2", base, len(base))
    bench_vocabulary("SmolLM2 widened", widened_tokenizer(base, QWEN3_VOCAB_SIZE), QWEN3_VOCAB_SIZE)


if __name__ == "__main__":
    main()
