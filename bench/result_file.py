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


def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()}


def write_result(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")
