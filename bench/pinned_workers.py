"""Workers of the default model as separate hosts would run them: each pinned to a core of its own
(``taskset``) with one torch thread, where the machine has the cores."""

from __future__ import annotations

import os
import shutil

from tests.support.stack import Stack
from worker.settings import DEFAULT_MODEL


def start_pinned_workers(stack: Stack, workers: int, max_model_len: int) -> bool:
    """``workers`` workers of the default model on ``stack``; whether each has a core of its own."""
    can_pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= workers
    for core in range(workers):
        pin = ("taskset", "-c", str(core)) if can_pin else ()
        stack.start_worker(
            DEFAULT_MODEL, DEFAULT_MODEL, command_prefix=pin, num_threads=1, max_model_len=max_model_len,
            log_level="WARNING",
        )  # fmt: skip
    return can_pin


def worker_points(spec: str) -> tuple[list[int], list[int]]:
    """The numbers of workers in ``spec`` (``"1,2,3"``) this host has the cores for, and those
    it skips (each said on stdout)."""
    fit, skipped = [], []
    for workers in (int(n) for n in spec.split(",")):
        if workers > (os.cpu_count() or 1):
            print(f"{workers} workers: skipped, this host has {os.cpu_count()} cores", flush=True)
            skipped.append(workers)
        else:
            fit.append(workers)
    return fit, skipped
