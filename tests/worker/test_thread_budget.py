"""A worker's torch threads are its share of the cores it may use (affinity, cgroup quota), and the
engine thread applies the count on its own thread. How the share follows the other workers on the
host: tests/worker/test_host_pool.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from worker.service.engine_thread import EngineThread
from worker.service.thread_budget import available_cores, threads_for

HOST = "host-a"


@pytest.mark.parametrize(
    ("num_cores", "num_sharing", "override", "expected"),
    [
        (2, 1, None, 2),
        (2, 2, None, 1),
        (2, 3, None, 1),  # never zero
        (8, 3, None, 2),
        (16, 4, None, 4),
        (2, 2, 4, 4),  # the flag wins
        (2, 1, 0, 2),  # a non-positive override is no override
    ],
)
def test_threads_for(num_cores: int, num_sharing: int, override: int | None, expected: int) -> None:
    assert threads_for(num_cores, num_sharing, override) == expected


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
        "from worker.service.thread_budget import available_cores; print(available_cores())"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


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

    def build() -> _CountingEngine:
        seen_at_load.append(torch.get_num_threads())
        return engine

    thread = EngineThread(build, num_threads=1)  # type: ignore[arg-type]
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
