"""A real agent CLI for end-to-end tests: qwen-code from the npm registry, installed once (pinned)
into the test cache, and run headless against a stack the way its users point it at a local server."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.models import test_cache_dir

QWEN_CODE = "@qwen-code/qwen-code@0.24.4"
# What a user of a local model sets: greedy decoding and a modest answer budget; no auto-update,
# telemetry, usage statistics or background memory agent (nothing leaves the machine).
SETTINGS: dict[str, Any] = {
    "model": {"generationConfig": {"samplingParams": {"temperature": 0, "max_tokens": 256}}},
    "memory": {"enableManagedAutoMemory": False},
    "general": {"enableAutoUpdate": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}


def npm_available() -> bool:
    return shutil.which("npm") is not None and shutil.which("node") is not None


def ensure_qwen_code() -> Path:
    """The ``qwen`` executable, installed with npm the first time (about 10 s)."""
    folder = test_cache_dir() / "npm" / QWEN_CODE.replace("/", "+")
    executable = folder / "node_modules" / ".bin" / "qwen"
    if executable.exists():
        return executable
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not executable.exists():
            subprocess.run(
                ["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund", "--loglevel=error", QWEN_CODE],
                check=True, capture_output=True, timeout=600,
            )  # fmt: skip
    return executable


@dataclass
class AgentRun:
    returncode: int
    messages: list[dict[str, Any]]  # the CLI's stream of JSON records (-o json)
    stderr: str

    @property
    def result(self) -> dict[str, Any]:
        return next(m for m in self.messages if m.get("type") == "result")

    def content_blocks(self, role: str) -> list[dict[str, Any]]:
        """Every content block of the ``role`` turns, in order (the CLI records Anthropic-style blocks)."""
        blocks: list[dict[str, Any]] = []
        for record in self.messages:
            message = record.get("message") or {}
            if record.get("type") == role and isinstance(message.get("content"), list):
                blocks += message["content"]
        return blocks


def run_qwen_code(
    executable: Path,
    base_url: str,
    model: str,
    auth_type: str,
    workdir: Path,
    home: Path,
    prompt: str,
    timeout_s: float,
) -> AgentRun:
    """One headless run (``-o json``, tools approved) in ``workdir``, with ``home`` as its HOME
    (outside ``workdir``: the CLI lists the working directory's files in its first prompt)."""
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(SETTINGS))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "NO_COLOR": "1", "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"}
    # The CLI drops a stream that sends no token for 240 s; a cold 16k-token prefill on a loaded
    # 2-core host can take longer, so the stream may wait as long as the run may.
    env["QWEN_STREAM_IDLE_TIMEOUT_MS"] = str(int(timeout_s * 1000))
    if auth_type == "anthropic":
        env |= {"ANTHROPIC_API_KEY": "unused", "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_MODEL": model}
    else:
        env |= {"OPENAI_API_KEY": "unused", "OPENAI_BASE_URL": f"{base_url}/v1", "OPENAI_MODEL": model}
    command = [str(executable), "--auth-type", auth_type, "--model", model, "--yolo", "-o", "json", prompt]
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )  # fmt: skip
    try:
        messages = json.loads(done.stdout)
    except ValueError:
        messages = []
    return AgentRun(done.returncode, messages if isinstance(messages, list) else [], done.stderr)
