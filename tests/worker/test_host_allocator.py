"""The CPU engine's allocator setting: a freed step-sized tensor is reused, not re-faulted."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Decode steps as a CPU engine runs them: logits over a 49k vocabulary, softmax, cumsum, for a
# batch that shrinks as sequences finish and refills. After a warm-up, prints the page faults
# that 20 rounds cost, with or without the setting.
_PROBE = """
import resource, sys, torch
from worker.engine.host_allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def step(rows):
    logits = torch.empty(rows, 49152).fill_(1.0)
    probs = torch.softmax(logits, -1)
    del logits
    cdf = probs.cumsum(-1)
    del probs
    return cdf[:, -1].clone()
def rounds(n):
    for _ in range(n):
        for rows in (48, 47, 46, 45, 44, 8, 48):
            step(rows)
rounds(10)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(20)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True).stdout
    applied, faults = out.split()
    return applied, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt")
def test_step_sized_tensors_stop_page_faulting() -> None:
    applied, kept = _faults("keep")
    assert applied == "True"
    _, default = _faults("default")
    pages = 48 * 49152 * 4 // 4096  # one full step's logits
    assert default > 4 * pages  # glibc's default maps most of them afresh and faults them in
    assert kept < pages  # all reused: not even one step's worth over 140 steps
