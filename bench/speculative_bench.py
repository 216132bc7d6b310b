"""Speculation on one stream: relaylm with ``--speculative ngram`` and ``off``, and llama.cpp's
llama-server plain and with each of its n-gram speculation modes, on the same GGUF, greedy, in
one run.

    python -m bench.speculative_bench [--model default|qwen2.5-coder-0.5b-instruct] [--rounds 3]

Two workloads: (a) edits, a 40-line source file in the prompt and a small change asked for, the
whole file answered (an answer that repeats its prompt); (b) open-ended prose. The two relaylm
stacks and the llama-server configurations (each on every core) are all up at once, and each
round runs every one of them in turn, the order rotated and reversed from round to round, so the
machine's drift falls on all of them alike. Reported: the decode
rate (tokens after the first over the time after the first), and whether each configuration's
text equals its plain one's: relaylm's must, byte for byte. llama-server is found as ``make
bench`` finds it (``make llama-server`` builds it); without one its rows are skipped.

Prints a table; writes bench/results/speculative.json (speculative-MODEL.json for another model).
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
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import llama_server_peer
from bench.perplexity_bench import model_and_gguf
from bench.result_file import machine, write_result
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.stack import Stack
from worker.models.named import NAMED_MODELS
from worker.settings import DEFAULT_MODEL

RESULTS = Path(__file__).parent / "results"
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")

SOURCE_FILE = """import csv
import sys
from dataclasses import dataclass


@dataclass
class Record:
    name: str
    city: str
    amount: float


def parse_line(line: str) -> Record:
    name, city, amount = line.strip().split(",")
    return Record(name=name, city=city, amount=float(amount))


def read_records(path: str) -> list[Record]:
    records = []
    with open(path) as handle:
        for line in handle:
            if line.strip():
                records.append(parse_line(line))
    return records


def total_by_city(records: list[Record]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for record in records:
        totals[record.city] = totals.get(record.city, 0.0) + record.amount
    return totals


def main() -> None:
    records = read_records(sys.argv[1])
    for city, total in sorted(total_by_city(records).items()):
        print(f"{city}: {total:.2f}")


if __name__ == "__main__":
    main()
"""
WORKLOADS = {
    "edit": (
        "Here is a Python file:\n\n```python\n" + SOURCE_FILE + "```\n\n"
        "Rename the function `parse_line` to `parse_row` everywhere. Reply with the complete updated file "
        "in one code block and nothing else."
    ),
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


async def _stream(base_url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy streamed chat completion: its text, completion tokens and decode rate."""
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    text: list[str] = []
    first, num_tokens = 0.0, 0
    async with (
        httpx.AsyncClient(timeout=900) as client,
        client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    finished = time.perf_counter()
    return {"text": "".join(text), "tokens": num_tokens, "decode_tok_s": (num_tokens - 1) / (finished - first)}


def _measure(base_url: str, model: str, workload: str, max_tokens: int) -> dict[str, Any]:
    return asyncio.run(_stream(base_url, model, WORKLOADS[workload], max_tokens))


@contextlib.contextmanager
def _relaylm_stacks(model: str) -> Iterator[dict[str, str]]:
    """Both relaylm settings, each a stack of its own on one Redis: their base URLs by name."""
    binary = find_redis_server()
    own = start_redis(binary) if binary else None
    redis_url = own.url if own else os.environ.get("RELAYLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    stacks: list[Stack] = []
    try:
        urls = {}
        for setting in ("ngram", "off"):
            stack = Stack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix=f"relaylm-spec-{setting}-")))
            stacks.append(stack)
            stack.start_api(log_level="WARNING")
            stack.start_worker(model, model, log_level="WARNING", max_model_len=2048, speculative=setting)
            urls[f"relaylm {setting}"] = stack.base_url
        yield urls
    finally:
        for stack in stacks:
            stack.stop()
        if own:
            own.stop()


def _llama_servers(args: argparse.Namespace, gguf: Path, stack: contextlib.ExitStack) -> dict[str, str]:
    """llama-server plain and in each n-gram mode, started in ``stack``: their base URLs by name."""
    binary = llama_server_peer.find_llama_server()
    if binary is None:
        print("llama-server skipped: none found (make llama-server builds one)", flush=True)
        return {}
    args.llama_server_version = llama_server_peer.version(binary)
    threads = len(os.sched_getaffinity(0))
    urls = {}
    for mode in ("plain", *LLAMA_SPEC_TYPES):
        extra = () if mode == "plain" else ("--spec-type", mode)
        running = llama_server_peer.running_llama_server(binary, gguf, 1, 2048, threads, extra)
        urls[f"llama-server {mode}"] = stack.enter_context(running)
    return urls


def _run_all(args: argparse.Namespace, model: str, gguf: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every system up at once (an idle one takes no CPU), then each round runs every system in
    turn, the order rotated and reversed from round to round, so the machine's drift falls on all
    of them alike: runs by system and workload."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with contextlib.ExitStack() as stack:
        urls = dict(stack.enter_context(_relaylm_stacks(model)))
        if args.llama_server == "auto":
            urls.update(_llama_servers(args, gguf, stack))
        for name, url in urls.items():
            _measure(url, _served_name(name, model), "prose", 16)  # warm up
        names = list(urls)
        for workload in WORKLOADS:
            for index in range(args.rounds):
                shift = index % len(names)
                order = names[shift:] + names[:shift]
                for name in order if index % 2 == 0 else order[::-1]:
                    run = _measure(urls[name], _served_name(name, model), workload, args.max_tokens)
                    runs.setdefault(name, {}).setdefault(workload, []).append(run)
                    print(f"{name} {workload} round {index}: {run['decode_tok_s']:.1f} tok/s", flush=True)
    return runs


def _served_name(system: str, model: str) -> str:
    return model if system.startswith("relaylm") else "peer"


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "decode_tok_s": statistics.median(run["decode_tok_s"] for run in runs),
        "rounds_tok_s": [round(run["decode_tok_s"], 2) for run in runs],
        "tokens": runs[0]["tokens"],
        "same_text_every_round": len({run["text"] for run in runs}) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", choices=["default", DEFAULT_MODEL, *NAMED_MODELS])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per configuration and workload")
    parser.add_argument("--max-tokens", type=int, default=600, help="the edit's whole file is ~450 tokens")
    parser.add_argument("--llama-server", choices=["auto", "off"], default="auto", help="off: relaylm's rows only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, gguf = model_and_gguf(args.model)
    out = args.out or (
        RESULTS / "speculative.json" if model == DEFAULT_MODEL else RESULTS / f"speculative-{model}.json"
    )

    runs = _run_all(args, model, gguf)
    systems = {name: {workload: _summary(r) for workload, r in by_name.items()} for name, by_name in runs.items()}
    for workload in WORKLOADS:
        pairs = [
            ("relaylm ngram", "relaylm off"),
            *((f"llama-server {m}", "llama-server plain") for m in LLAMA_SPEC_TYPES),
        ]
        for name, reference in pairs:
            if name in systems and reference in systems:
                same = runs[name][workload][0]["text"] == runs[reference][workload][0]["text"]
                systems[name][workload]["same_text_as_" + reference.split()[-1]] = same

    ratios: dict[str, dict[str, float]] = {}
    best_llama_mode: dict[str, str] = {}
    for workload in WORKLOADS:
        ours = systems["relaylm ngram"][workload]["decode_tok_s"]
        ratios[workload] = {"ngram_over_off": ours / systems["relaylm off"][workload]["decode_tok_s"]}
        if "llama-server plain" in systems:
            ratios[workload]["ngram_over_llama_plain"] = ours / systems["llama-server plain"][workload]["decode_tok_s"]
            best = max(LLAMA_SPEC_TYPES, key=lambda m: systems[f"llama-server {m}"][workload]["decode_tok_s"])
            best_llama_mode[workload] = best
            ratios[workload]["ngram_over_llama_best_ngram"] = (
                ours / systems[f"llama-server {best}"][workload]["decode_tok_s"]
            )

    print()
    print("| system | workload | decode tok/s (median) | tokens | text as its plain run |")
    print("|---|---|---:|---:|---|")
    for name, by_workload in systems.items():
        for workload, summary in by_workload.items():
            same = next((v for k, v in summary.items() if k.startswith("same_text_as_")), None)
            shown = "—" if same is None else ("same" if same else "differs")
            print(f"| {name} | {workload} | {summary['decode_tok_s']:.1f} | {summary['tokens']} | {shown} |")
    print()
    for workload, by_ratio in ratios.items():
        shown = ", ".join(f"{name} {value:.2f}" for name, value in by_ratio.items())
        print(
            f"{workload}: {shown}"
            + (f" (llama-server's best: {best_llama_mode[workload]})" if workload in best_llama_mode else "")
        )
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.speculative_bench" + (f" --model {args.model}" if args.model != "default" else ""),
        "model": model,
        "gguf": gguf.name,
        "llama_server": getattr(args, "llama_server_version", None),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "systems": systems,
        "ratios": ratios,
        "best_llama_ngram_mode": best_llama_mode,
    }
    write_result(out, report)


if __name__ == "__main__":
    main()
