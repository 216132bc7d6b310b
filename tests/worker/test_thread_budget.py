"""A worker's torch threads are its share of the host's cores: the share follows the live workers
on its host in the registry (real Redis), and the engine thread applies it on its own thread."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from redis.asyncio import Redis

from shared.redis_keys import RedisKeys
from shared.registry import WorkerInfo
from worker.engine_thread import EngineThread
from worker.thread_budget import ThreadBudget, available_cores, threads_for

HOST = "host-a"


@pytest.mark.parametrize(
    ("num_cores", "num_workers", "override", "expected"),
    [
        (2, 1, None, 2),
        (2, 2, None, 1),
        (2, 3, None, 1),  # never zero
        (8, 3, None, 2),
        (16, 4, None, 4),
        (4, 0, None, 4),  # before this worker's own record is visible
        (2, 2, 4, 4),  # the flag wins
        (2, 1, 0, 2),  # a non-positive override is no override
    ],
)
def test_threads_for(num_cores: int, num_workers: int, override: int | None, expected: int) -> None:
    assert threads_for(num_cores, num_workers, override) == expected


# -- available_cores --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        (None, 4),  # no cgroup v2 file
        ("max 100000\n", 4),  # no quota
        ("150000 100000\n", 2),  # 1.5 cores round up
        ("50000 100000\n", 1),  # half a core is still one thread
        ("800000 100000\n", 4),  # a quota above the affinity does not add cores
    ],
)
def test_available_cores_takes_the_smaller_of_affinity_and_cgroup_quota(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpu_max: str | None, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert available_cores(path) == expected


def test_available_cores_without_affinity_falls_back_to_cpu_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert available_cores(tmp_path / "absent") == 3


def test_available_cores_respects_a_taskset_pin() -> None:
    script = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from worker.thread_budget import available_cores; print(available_cores())"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


# -- ThreadBudget against the registry --------------------------------------------------------
@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


async def _register(redis: Redis, keys: RedisKeys, worker_id: str, model: str, host: str) -> None:
    """Write a registry record as WorkerRegistration.beat does."""
    now = time.time()
    info = WorkerInfo(
        worker_id=worker_id, model=model, state="ready", host=host, pid=1, started_at=now, heartbeat_at=now
    )
    await redis.set(keys.worker(worker_id), info.model_dump_json(), ex=30)
    await redis.sadd(keys.model_workers(model), worker_id)
    await redis.hset(keys.models(), model, "{}")


async def test_refresh_follows_the_live_workers_on_this_host(redis: Redis) -> None:
    keys = RedisKeys(prefix=f"t{uuid.uuid4().hex[:8]}")
    applied: list[int] = []
    budget = ThreadBudget(redis, keys, HOST, override=None, apply=applied.append, num_cores=2)
    await _register(redis, keys, "me", "model-1", HOST)
    await _register(redis, keys, "elsewhere-1", "model-1", "host-b")
    await _register(redis, keys, "elsewhere-2", "model-2", "host-b")
    assert await budget.refresh() == 2

    await _register(redis, keys, "neighbour", "model-2", HOST)  # another model, same host
    assert await budget.refresh() == 1

    # Its heartbeat record expired; the model's worker set still lists it until a reader prunes it.
    await redis.delete(keys.worker("neighbour"))
    assert await budget.refresh() == 2
    assert await budget.refresh() == 2
    assert applied == [2, 1, 2]  # applied on change only


async def test_refresh_with_an_override_applies_it_whatever_the_count(redis: Redis) -> None:
    keys = RedisKeys(prefix=f"t{uuid.uuid4().hex[:8]}")
    applied: list[int] = []
    budget = ThreadBudget(redis, keys, HOST, override=3, apply=applied.append, num_cores=2)
    for worker_id in ("me", "neighbour"):
        await _register(redis, keys, worker_id, "model-1", HOST)
    assert await budget.refresh() == 3
    assert applied == [3]


async def test_refresh_on_an_empty_registry_takes_every_core(redis: Redis) -> None:
    keys = RedisKeys(prefix=f"t{uuid.uuid4().hex[:8]}")
    budget = ThreadBudget(redis, keys, HOST, override=None, apply=lambda _n: None, num_cores=2)
    assert await budget.refresh() == 2


async def test_the_refresh_loop_picks_up_a_new_neighbour(redis: Redis) -> None:
    keys = RedisKeys(prefix=f"t{uuid.uuid4().hex[:8]}")
    applied: list[int] = []
    budget = ThreadBudget(redis, keys, HOST, override=None, apply=applied.append, num_cores=2, interval_s=0.02)
    await _register(redis, keys, "me", "model-1", HOST)
    await budget.refresh()
    budget.start()
    try:
        await _register(redis, keys, "neighbour", "model-1", HOST)
        async with asyncio.timeout(5):
            while applied[-1] != 1:
                await asyncio.sleep(0.01)
    finally:
        await budget.stop()
    assert applied == [2, 1]


async def test_the_refresh_loop_survives_redis_errors(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    unreachable = Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    applied: list[int] = []
    budget = ThreadBudget(unreachable, RedisKeys(), HOST, None, applied.append, num_cores=2, interval_s=0.01)
    budget.start()
    try:
        async with asyncio.timeout(10):
            while "could not count the workers" not in caplog.text:
                await asyncio.sleep(0.01)
        assert budget._task is not None and not budget._task.done()
    finally:
        await budget.stop()
        await unreachable.aclose()
    assert applied == []


# -- EngineThread -----------------------------------------------------------------------------
class _CountingEngine:
    """Stands in for an engine: each step records torch's thread count as its own thread sees it."""

    def __init__(self) -> None:
        self.before_step: object = None
        self.num_threads_seen: list[int] = []
        self._stopping = threading.Event()

    def run_forever(self) -> None:
        while not self._stopping.is_set():
            if callable(self.before_step):
                self.before_step()
            self.num_threads_seen.append(torch.get_num_threads())
            time.sleep(0.005)

    def stop(self) -> None:
        self._stopping.set()


async def test_engine_thread_applies_thread_counts_on_its_own_thread() -> None:
    seen_at_load: list[int] = []
    engine = _CountingEngine()
    thread = EngineThread(
        lambda: seen_at_load.append(torch.get_num_threads()),  # type: ignore[arg-type,return-value]
        lambda _loaded: engine,  # type: ignore[arg-type,return-value]
        num_threads=1,
    )
    num_threads_here = torch.get_num_threads()
    await thread.start()
    try:
        thread.set_num_threads(2)
        async with asyncio.timeout(5):
            while not engine.num_threads_seen or engine.num_threads_seen[-1] != 2:
                await asyncio.sleep(0.01)
    finally:
        engine.stop()
        await asyncio.wait_for(thread.exited(), 5)
    assert seen_at_load == [1]  # set before the model loads
    assert engine.num_threads_seen[0] in (1, 2)
    assert torch.get_num_threads() == num_threads_here  # OpenMP's count is per thread: ours is untouched
