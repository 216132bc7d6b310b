"""The KV cache held by tokens against full-length slots, the in-process engine on the default model:

1. parity: 32 streams with a 1,024-token context, where the slot cache has slots to spare, each
   layout run three times, alternated, on the same requests (``make bench`` runs this too): what
   the layout itself costs;
2. the default context: 64 streams with the model's whole 8,192-token context and the default
   4 GiB, where the slot cache fits 21 sequences at once: what holding KV by tokens gives;
3. a shared system prompt: 32 streams whose prompts begin with the same ~2,000 tokens (seen
   once before, as an agent's tool list is), the prefix held once against copied into each
   sequence's slot: KV blocks held at the peak, tok/s, TTFT.

    python -m bench.kv_layout_bench [--streams 32] [--output-tokens 128]

Prints both; writes ``bench/results/kv_layout.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.in_process import InProcessEngine
from bench.result_file import cpu_name
from bench.serving_bench import RESULTS, bodies_for, engine_config, kv_layout_scenario
from bench.stats import summarize
from bench.workload import chat_prompt_ids, distinct_prompts
from worker.engine.builder import EngineConfig, default_max_num_batched_tokens
from worker.models.loader import load_model
from worker.settings import DEFAULT_MODEL, WorkerSettings


def full_context_scenario(
    loaded: Any, args: argparse.Namespace, texts: list[str], streams: int = 64, max_model_len: int = 8192
) -> dict[str, dict[str, float | None]]:
    """``streams`` requests at once with the model's whole context: the slot cache runs as many as
    full-length slots fit, the token-held cache all of them."""
    base = {**engine_config(args, streams).__dict__, "max_model_len": max_model_len}
    result: dict[str, dict[str, float | None]] = {}
    for label in ("tokens", "slots"):
        engine = InProcessEngine(
            loaded, EngineConfig(**{**base, "kv_layout": "auto" if label == "tokens" else "slots"})
        )
        engine.run(bodies_for(texts[:1], 8))  # warm-up
        summary = summarize(label, streams, engine.run(bodies_for(texts[:streams], args.output_tokens)))
        result[label] = {"tok_s": summary.tok_s, "peak_running": engine.peak_running,
                         "ttft_p50_ms": summary.ttft_p50_ms, "ttft_p99_ms": summary.ttft_p99_ms}  # fmt: skip
        engine.close()
        print(f"  {streams} streams, context {max_model_len}, {label}: {result[label]}", flush=True)
    return result


def system_prompt_text(tokenizer: Any, min_tokens: int) -> str:
    """An agent-like system prompt of at least ``min_tokens`` tokens: a list of tools."""
    lines = ["You are a coding agent. You may call these tools:"]
    while len(chat_prompt_ids(tokenizer, [{"role": "system", "content": "\n".join(lines)}])) < min_tokens:
        i = len(lines)
        lines.append(f"- tool_{i}(path, start, end): returns lines start to end of path, numbered from {i}.")
    return "\n".join(lines)


def shared_prompt_scenario(
    loaded: Any, args: argparse.Namespace, streams: int = 32, system_tokens: int = 2000, max_model_len: int = 8192
) -> dict[str, Any]:
    """``streams`` requests at once whose prompts share a system prompt of ``system_tokens``, after
    one request with it: the prefix held once (the default) against copied into every slot."""
    loaded = dataclasses.replace(loaded, max_model_len=max_model_len)  # loaded for make bench's 1,024
    system = system_prompt_text(loaded.tokenizer, system_tokens)
    bodies = bodies_for([f"Question {i}: which tool reads file number {i}?" for i in range(streams + 1)], 64)
    for body in bodies:
        body["messages"] = [{"role": "system", "content": system}, *body["messages"]]
    base = {**engine_config(args, streams).__dict__, "max_model_len": max_model_len}
    result: dict[str, Any] = {
        "streams": streams,
        "system_prompt_tokens": len(chat_prompt_ids(loaded.tokenizer, [{"role": "system", "content": system}])),
    }
    for label in ("held_once", "copied"):
        engine = InProcessEngine(loaded, EngineConfig(**{**base, "share_prefixes": label == "held_once"}))
        engine.run(bodies[:1])  # the system prompt seen once before
        summary = summarize(label, streams, engine.run(bodies[1:]))
        result[label] = {
            "peak_kv_blocks": engine.peak_kv_blocks,
            "peak_shared_blocks": engine.peak_shared_blocks,
            "block_tokens": engine.engine.scheduler.budget.block_tokens,
            "hit_rate": engine.prefix_hit_rate(),
            "tok_s": summary.tok_s,
            "ttft_p50_ms": summary.ttft_p50_ms,
        }
        engine.close()
        print(f"  {streams} streams sharing a system prompt, prefix {label}: {result[label]}", flush=True)
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
    shared_prompt = shared_prompt_scenario(loaded, args)
    flags = ("streams", "prompt_tokens", "output_tokens", "max_model_len")
    shown = [(k, v) for k, v in vars(args).items() if k in flags]
    report = {
        "command": "python -m bench.kv_layout_bench " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in shown),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads()},
        "model": DEFAULT_MODEL,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        **result,
        "default_context_64_streams": full_context,
        "shared_system_prompt_32_streams": shared_prompt,
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
    tokens = shared_prompt["system_prompt_tokens"]
    print(f"\n| 32 streams, one {tokens}-token system prompt | KV blocks held at peak | of them shared "
          "| prefix hit rate | tok/s | TTFT p50 ms |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for label, name in (("held_once", "prefix held once"), ("copied", "prefix copied into each slot")):
        row = shared_prompt[label]
        cells = [f"{row['peak_kv_blocks']}", f"{row['peak_shared_blocks']}", f"{row['hit_rate']:.1%}"]
        cells += [f"{row['tok_s']:.1f}", f"{row['ttft_p50_ms']:.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
