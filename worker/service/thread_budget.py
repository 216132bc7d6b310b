"""The cores a worker may use and its torch thread count among the workers that share them.

``worker.service.host_pool`` re-counts the sharing workers as they come, go, and turn busy or idle.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores(cpu_max_path: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may use: its CPU affinity (taskset), capped by a cgroup v2 CPU quota."""
    get_affinity = getattr(os, "sched_getaffinity", None)
    num_cores = len(get_affinity(0)) if get_affinity is not None else (os.cpu_count() or 1)
    quota_cores = _cgroup_quota_cores(cpu_max_path)
    return min(num_cores, quota_cores) if quota_cores is not None else num_cores


def _cgroup_quota_cores(cpu_max_path: Path) -> int | None:
    """``cpu.max`` holds "<quota_us> <period_us>", or "max <period_us>" when there is no quota."""
    try:
        quota_us, period_us = cpu_max_path.read_text().split()
        return max(1, math.ceil(int(quota_us) / int(period_us)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def cpu_set() -> list[int]:
    """The CPUs this process may run on (empty where the platform does not say)."""
    get_affinity = getattr(os, "sched_getaffinity", None)
    return sorted(get_affinity(0)) if get_affinity is not None else []


def threads_for(num_cores: int, num_sharing: int, override: int | None) -> int:
    """Torch threads for one of ``num_sharing`` busy workers on the same cores: the override when
    given, else an equal share of the cores."""
    if override is not None and override > 0:
        return override
    return max(1, num_cores // max(1, num_sharing))
