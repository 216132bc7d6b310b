"""The KV cache held by tokens against full-length slots: the in-process engine at 32 streams on
the default model, each layout run three times, alternated, on the same requests (what
``make bench`` also runs as its last scenario).

    python -m bench.kv_layout_bench [--streams 32] [--output-tokens 128]

Prints the tok/s of every run and the ratio of the medians; writes ``bench/results/kv_layout.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.serving_bench import RESULTS, kv_layout_scenario
from bench.workload import distinct_prompts
from worker.engine.builder import default_max_num_batched_tokens
from worker.model_loader import load_model
from worker.settings import DEFAULT_MODEL, WorkerSettings


def _cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


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
    texts = distinct_prompts(loaded.tokenizer, args.streams, args.prompt_tokens)
    result = kv_layout_scenario(loaded, args, texts, args.streams)
    flags = ("streams", "prompt_tokens", "output_tokens", "max_model_len")
    shown = [(k, v) for k, v in vars(args).items() if k in flags]
    report = {
        "command": "python -m bench.kv_layout_bench " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in shown),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": _cpu_model(), "threads": torch.get_num_threads()},
        "model": DEFAULT_MODEL,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("| layout | tok/s (3 runs, alternated) | median |")
    print("|---|---|---:|")
    for label, key in (("held by tokens", "tok_s_held_by_tokens"), ("full-length slots", "tok_s_full_length_slots")):
        runs = result[key]
        print(f"| {label} | {', '.join(f'{v:.1f}' for v in runs)} | {sorted(runs)[1]:.1f} |")
    print(f"ratio of medians: {result['ratio_of_medians']:.3f}x; wrote {args.out}")


if __name__ == "__main__":
    main()
