"""What other processes do to a benchmark on a shared machine: the cores they keep busy.

CTranslate2's and torch's OpenMP threads wait for each other at every parallel region; when a
core they count on is taken by another job, each region waits for it, and a run on 2 cores with
one of them busy elsewhere can take many times longer (not twice). A benchmark that says how
much other load each run had, and waits for a quiet moment first, can be read on such a machine."""

from __future__ import annotations

import time

import psutil

QUIET_CORES = 0.15  # other load below this counts as quiet before a run starts
CONTENDED_CORES = 0.25  # a run with more other load than this is not comparable with a quiet one
QUIET_PROBE_S = 1.0


class OtherLoad:
    """Cores kept busy (steal time included) by processes other than ``pids``."""

    def __init__(self, pids: list[int], max_wait_s: float = 30.0) -> None:
        self.processes = [psutil.Process(pid) for pid in pids]
        self.max_wait_s = max_wait_s

    def sample(self) -> tuple[float, float, float]:
        """(monotonic seconds, the machine's busy CPU seconds, those of ``pids``)."""
        t = psutil.cpu_times()
        busy = t.user + t.nice + t.system + t.irq + t.softirq + t.steal
        return time.monotonic(), busy, sum(sum(p.cpu_times()[:2]) for p in self.processes)

    def cores_since(self, before: tuple[float, float, float]) -> float:
        now = self.sample()
        return max(0.0, (now[1] - before[1]) - (now[2] - before[2])) / (now[0] - before[0])

    def wait_for_quiet(self) -> float:
        """Wait (at most ``max_wait_s``) for a second of other load under ``QUIET_CORES``; the seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < self.max_wait_s:
            before = self.sample()
            time.sleep(QUIET_PROBE_S)
            if self.cores_since(before) < QUIET_CORES:
                break
        return time.monotonic() - started
