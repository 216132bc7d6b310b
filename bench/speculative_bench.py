"""Speculation on one stream: relaylm with ``--speculative ngram`` and ``off``, and llama.cpp's
llama-server plain and with each of its n-gram speculation modes, on the same GGUF, greedy, in
one run.

    python -m bench.speculative_bench [--model default|qwen2.5-coder-0.5b-instruct] [--rounds 3]

Two workloads: (a) edits, a 40-line source file in the prompt and a small change asked for, the
whole file answered (an answer that repeats its prompt); (b) open-ended prose. The two relaylm
stacks run side by side and take turns (ABBA), so the machine's drift falls on both; the
llama-server configurations run one after another, each on every core. Reported: the decode
rate (tokens after the first over the time after the first), and whether each configuration's
text equals its plain one's: relaylm's must, byte for byte. llama-server is found as ``make
bench`` finds it (``make llama-server`` builds it); without one its rows are skipped.

Prints a table; writes bench/results/speculative.json (speculative-MODEL.json for another model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
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


def _relaylm(args: argparse.Namespace, model: str) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Both settings side by side, in ABBA rounds per workload."""
    binary = find_redis_server()
    own = start_redis(binary) if binary else None
    redis_url = own.url if own else os.environ.get("RELAYLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    stacks: dict[str, Stack] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"ngram": {}, "off": {}}
    try:
        for setting in runs:
            stack = Stack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix=f"relaylm-spec-{setting}-")))
            stacks[setting] = stack
            stack.start_api(log_level="WARNING")
            stack.start_worker(model, model, log_level="WARNING", max_model_len=2048, speculative=setting)
            _measure(stack.base_url, model, "prose", 16)  # warm up
        for workload in WORKLOADS:
            for index in range(args.rounds):
                for setting in ("ngram", "off") if index % 2 == 0 else ("off", "ngram"):
                    run = _measure(stacks[setting].base_url, model, workload, args.max_tokens)
                    runs[setting].setdefault(workload, []).append(run)
                    print(f"relaylm {setting} {workload} round {index}: {run['decode_tok_s']:.1f} tok/s", flush=True)
    finally:
        for stack in stacks.values():
            stack.stop()
        if own:
            own.stop()
    return runs


def _llama_server(args: argparse.Namespace, gguf: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    binary = llama_server_peer.find_llama_server()
    if binary is None:
        print("llama-server skipped: none found (make llama-server builds one)", flush=True)
        return {}
    args.llama_server_version = llama_server_peer.version(binary)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    threads = len(os.sched_getaffinity(0))
    for mode in ("plain", *LLAMA_SPEC_TYPES):
        extra = () if mode == "plain" else ("--spec-type", mode)
        with llama_server_peer.running_llama_server(binary, gguf, 1, 2048, threads, extra) as url:
            _measure(url, "peer", "prose", 16)
            for workload in WORKLOADS:
                for index in range(args.rounds):
                    run = _measure(url, "peer", workload, args.max_tokens)
                    runs.setdefault(mode, {}).setdefault(workload, []).append(run)
                    print(f"llama-server {mode} {workload} round {index}: {run['decode_tok_s']:.1f} tok/s", flush=True)
    return runs


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

    relaylm = _relaylm(args, model)
    llama = _llama_server(args, gguf) if args.llama_server == "auto" else {}
    systems: dict[str, dict[str, dict[str, Any]]] = {}
    for setting, by_workload in relaylm.items():
        systems[f"relaylm {setting}"] = {workload: _summary(runs) for workload, runs in by_workload.items()}
    for mode, by_workload in llama.items():
        systems[f"llama-server {mode}"] = {workload: _summary(runs) for workload, runs in by_workload.items()}
    for workload in WORKLOADS:
        pairs = [
            ("relaylm ngram", "relaylm off"),
            *((f"llama-server {m}", "llama-server plain") for m in LLAMA_SPEC_TYPES),
        ]
        for name, reference in pairs:
            if name in systems and reference in systems:
                same = _first_text(relaylm, llama, name, workload) == _first_text(relaylm, llama, reference, workload)
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


def _first_text(
    relaylm: dict[str, dict[str, list[dict[str, Any]]]],
    llama: dict[str, dict[str, list[dict[str, Any]]]],
    name: str,
    workload: str,
) -> str:
    system, _, setting = name.partition(" ")
    runs = relaylm if system == "relaylm" else llama
    return str(runs[setting][workload][0]["text"])


if __name__ == "__main__":
    main()
