"""``relaylm serve`` (what ``make serve`` runs): starts Redis when none answers, a worker and the
API; answers requests; Ctrl-C stops everything it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest

from tests.support.stack import free_port

pytestmark = pytest.mark.slow


def _wait_for(path: Path, text: str, process: subprocess.Popen[bytes], timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = path.read_text(errors="replace")
        if text in log:
            return log
        if process.poll() is not None:
            raise AssertionError(f"serve exited early:\n{log}")
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared:\n{path.read_text(errors='replace')}")


def test_serve_runs_everything_and_ctrl_c_stops_it(tiny_model_path: Path, tmp_path: Path) -> None:
    api_port, redis_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYLM_") and k != "REDIS_URL"}
    command = [sys.executable, "-m", "relaylm", "serve", "--port", str(api_port)]
    command += ["--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--model", str(tiny_model_path)]
    command += ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        banner = _wait_for(log_path, "relaylm serve: ready", process)
        assert f"redis://127.0.0.1:{redis_port}/0  (started here" in banner
        assert f"http://127.0.0.1:{api_port}/v1" in banner
        children = psutil.Process(process.pid).children(recursive=True)
        assert len(children) == 3  # redis-server, worker, API
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.choices[0].finish_reason in ("stop", "length")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=45) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        if process.poll() is None:
            process.kill()
