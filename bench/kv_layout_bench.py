"""The KV cache held by tokens against full-length slots, the in-process engine on the default model:

1. parity: 32 streams with a 1,024-token context, where the slot cache has slots to spare, each
   layout run three times, alternated, on the same requests (``make bench`` runs this too): what
   the layout itself costs;
2. the default context: 64 streams with the model's whole 8,192-token context and the default
   4 GiB, where the slot cache fits 21 sequences at once: what holding KV by tokens gives.

    python -m bench.kv_layout_bench [--streams 32] [--output-tokens 128]

Prints both; writes ``bench/results/kv_layout.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.in_process import InProcessEngine
from bench.serving_bench import RESULTS, bodies_for, engine_config, kv_layout_scenario
from bench.stats import summarize
from bench.workload import distinct_prompts
from worker.engine.builder import EngineConfig, default_max_num_batched_tokens
from worker.model_loader import load_model
from worker.settings import DEFAULT_MODEL, WorkerSettings


def _cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def full_context_scenario(
    loaded: Any, args: argparse.Namespace, texts: list[str], streams: int = 64, max_model_len: int = 8192
) -> dict[str, dict[str, float | None]]:
    """``streams`` requests at once with the model's whole context: the slot cache runs as many as
    full-length slots fit, the token-held cache all of them."""
    base = {**engine_config(args, streams).__dict__, "max_model_len": max_model_len}
    result: dict[str, dict[str, float | None]] = {}
    for label in ("tokens", "slots"):
        engine = InProcessEngine(loaded, EngineConfig(**{**base, "kv_held_by_tokens": label == "tokens"}))
        engine.run(bodies_for(texts[:1], 8))  # warm-up
        summary = summarize(label, streams, engine.run(bodies_for(texts[:streams], args.output_tokens)))
        result[label] = {"tok_s": summary.tok_s, "peak_running": engine.peak_running,
                         "ttft_p50_ms": summary.ttft_p50_ms, "ttft_p99_ms": summary.ttft_p99_ms}  # fmt: skip
        engine.close()
        print(f"  {streams} streams, context {max_model_len}, {label}: {result[label]}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    # make bench's: the slot cache then has slots to spare (182 of 4 GiB), so both run every stream
    # at once and the ratio is the cost of the layout itself, not the slot cache's concurrency cap.
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_layout.json")
    args = parser.parse_args()
    loaded = load_model(DEFAULT_MODEL, WorkerSettings().cache_dir, "auto", "auto", args.max_model_len)
    args.max_num_batched_tokens = default_max_num_batched_tokens(loaded.model.device)
    texts = distinct_prompts(loaded.tokenizer, max(args.streams, 64), args.prompt_tokens)
    result = kv_layout_scenario(loaded, args, texts, args.streams)
    full_context = full_context_scenario(loaded, args, texts)
    flags = ("streams", "prompt_tokens", "output_tokens", "max_model_len")
    shown = [(k, v) for k, v in vars(args).items() if k in flags]
    report = {
        "command": "python -m bench.kv_layout_bench " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in shown),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": _cpu_model(), "threads": torch.get_num_threads()},
        "model": DEFAULT_MODEL,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        **result,
        "default_context_64_streams": full_context,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("| layout | tok/s (3 runs, alternated) | median |")
    print("|---|---|---:|")
    for label, key in (("held by tokens", "tok_s_held_by_tokens"), ("full-length slots", "tok_s_full_length_slots")):
        runs = result[key]
        print(f"| {label} | {', '.join(f'{v:.1f}' for v in runs)} | {sorted(runs)[1]:.1f} |")
    print(f"ratio of medians: {result['ratio_of_medians']:.3f}x")
    print("\n| 64 streams, 8,192-token context, 4 GiB | at once | tok/s | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---:|---:|---:|---:|")
    for label, name in (("tokens", "held by tokens"), ("slots", "full-length slots")):
        row = full_context[label]
        cells = [f"{row['peak_running']}", f"{row['tok_s']:.1f}"]
        cells += [f"{row['ttft_p50_ms']:.0f}", f"{row['ttft_p99_ms']:.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
