"""What a long prompt costs on the exact kernels, where attention grows with the prompt's square:
the attention kernel alone on SmolLM2-135M's and Qwen2.5-0.5B's head shapes, a prefill chunk of
256 queries (a CPU step's) and a decode step's one query at the end of a 2k, 8k and 16k-token
context, on each code path this CPU runs (AVX512-VNNI where it has it, AVX2, the portable C++;
all three give the same bits); then the default model's time to first token, in this process,
for prompts of 1k, 4k and 7.5k tokens.

    python -m bench.long_prompt

Prints three tables; writes bench/results/long_prompt.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.in_process import InProcessEngine
from bench.result_file import machine, write_result
from bench.serving_bench import bodies_for
from bench.workload import fit_words
from worker.engine.builder import EngineConfig, default_max_num_batched_tokens
from worker.models.loader import load_model
from worker.native import exact
from worker.settings import DEFAULT_MODEL, WorkerSettings

RESULTS = Path(__file__).parent / "results" / "long_prompt.json"
HEADS = {"smollm2-135m": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64)}  # heads, kv heads, head dim
CONTEXTS = (2048, 8192, 16384)
CHUNK = 256  # queries: a CPU engine step's tokens (default_max_num_batched_tokens)
PORTABLE_UP_TO = 2048  # past it the portable code takes seconds a call
PROMPT_TOKENS = (1000, 4000, 7500)
MAX_LEN = 8192  # the default model's context


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="timed calls (kernel) or prompts (TTFT) per point")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def kernel_ms(shape: tuple[int, int, int], context: int, queries: int, path: str, runs: int) -> float:
    heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(context)
    query = torch.randn(1, heads, queries, dim, generator=generator).bfloat16()
    key = torch.randn(1, kv_heads, context, dim, generator=generator).bfloat16()
    value = torch.randn(1, kv_heads, context, dim, generator=generator).bfloat16()
    positions = torch.arange(context - queries, context)[None, :]
    options = {"avx512": {}, "avx2": {"scalar": True}, "portable": {"portable": True}}[path]
    exact.attention(query, key, value, positions, dim**-0.5, **options)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        exact.attention(query, key, value, positions, dim**-0.5, **options)
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 2)


def kernel_table(runs: int, queries: int) -> dict[str, Any]:
    """Each head shape and context, each path: ``queries`` at the end of the context (a prefill
    chunk, or a decode step's one); the portable code's prefill only at the shortest context."""
    paths = (["avx512"] if exact.has_vector_path() else []) + ["avx2", "portable"]
    table: dict[str, Any] = {}
    print(f"\n{queries} queries\n| heads | context | {' | '.join(f'{p} ms' for p in paths)} |")
    print(f"|---|---:|{'---:|' * len(paths)}")
    for name, shape in HEADS.items():
        for context in CONTEXTS:
            row = {
                p: kernel_ms(shape, context, queries, p, runs)
                for p in paths
                if p != "portable" or queries == 1 or context <= PORTABLE_UP_TO
            }
            table[f"{name}@{context}"] = row
            print(f"| {name} | {context} | {' | '.join(str(row.get(p, '-')) for p in paths)} |", flush=True)
    return table


def long_text(tokenizer: Any, seed: int, num_tokens: int) -> str:
    """A user message of distinct numbered words whose templated prompt is ``num_tokens`` long (or
    as close as words allow): no two prompts share more than their template's first tokens."""
    return fit_words(tokenizer, [f"s{seed}w{i}" for i in range(num_tokens)], num_tokens)


def ttft_table(runs: int) -> dict[str, float]:
    loaded = load_model(DEFAULT_MODEL, WorkerSettings().cache_dir, "auto", "auto", MAX_LEN, deterministic=True)
    step_tokens = default_max_num_batched_tokens(torch.device("cpu"))
    config = EngineConfig(
        max_num_seqs=1, max_num_batched_tokens=step_tokens, max_model_len=MAX_LEN, kv_cache_bytes=2**30
    )
    engine = InProcessEngine(loaded, config)
    engine.run(bodies_for([long_text(loaded.tokenizer, -1, 200)], 1))  # warm-up
    table: dict[str, float] = {}
    print("\n| prompt tokens | TTFT s (median) |\n|---:|---:|")
    for tokens in PROMPT_TOKENS:
        times = []
        for text in (long_text(loaded.tokenizer, tokens + run, tokens) for run in range(runs)):
            ttft = engine.run(bodies_for([text], 1))[0].ttft_s
            assert ttft is not None
            times.append(ttft)
        table[str(tokens)] = round(statistics.median(times), 2)
        print(f"| {tokens} | {table[str(tokens)]} |", flush=True)
    engine.close()
    return table


def main() -> None:
    args = parse_args()
    report = {"machine": machine(), "threads": torch.get_num_threads(), "chunk_queries": CHUNK}
    report["attention_ms"] = kernel_table(args.runs, CHUNK)
    report["decode_attention_ms"] = kernel_table(max(args.runs, 20), 1)
    report["ttft_s"] = ttft_table(args.runs)
    write_result(args.out, report)


if __name__ == "__main__":
    main()
