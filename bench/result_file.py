"""What every benchmark's JSON says of the machine it ran on, and how it is written."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name, as lscpu (else /proc/cpuinfo) gives it."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    for line in lscpu.splitlines() + Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("Model name:", "model name")):
            return line.split(":", 1)[1].strip()
    return "unknown"


# The vector extensions the exact kernels choose their code by (and AMX, which oneDNN uses).
_VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_features() -> dict[str, Any]:
    """The CPU family number and its vector extensions: a VM's model name ("AMD EPYC") does not
    tell an AVX2-only CPU from one with AVX-512."""
    cpuinfo = Path("/proc/cpuinfo")
    family: int | None = None
    flags: set[str] = set()
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        key, _, value = line.partition(":")
        if key.strip() == "cpu family" and family is None:
            family = int(value)
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"cpu_family": family, "vector": [flag for flag in _VECTOR_FLAGS if flag in flags]}


def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), **cpu_features(), "cores": os.cpu_count(), "python": platform.python_version()}


def write_result(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")
