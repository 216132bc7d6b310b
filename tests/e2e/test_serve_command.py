"""``relaylm serve`` (what ``make serve`` runs): starts Redis when none answers, a worker per model
and the API; answers requests; restarts what dies; Ctrl-C stops everything it started."""

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

from relaylm.supervisor import RestartBackoff, describe_exit
from tests.support.stack import START_TIMEOUT_S, free_port
from worker.embedding.loader import DEFAULT_EMBEDDING_MODEL
from worker.native.compiled_decode import can_compile
from worker.settings import DEFAULT_MODEL

pytestmark = pytest.mark.slow


def _wait_for(
    path: Path, text: str, process: subprocess.Popen[bytes], timeout_s: float = START_TIMEOUT_S, count: int = 1
) -> str:
    """The log once ``text`` is in it ``count`` times; the default wait is a worker's start."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = path.read_text(errors="replace")
        if log.count(text) >= count:
            return log
        if process.poll() is not None:
            raise AssertionError(f"serve exited early:\n{log}")
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared {count} time(s):\n{path.read_text(errors='replace')}")


def _start_serve(log_path: Path, api_port: int, redis_port: int, *args: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYLM_") and k != "REDIS_URL"}
    command = [sys.executable, "-m", "relaylm", "serve", "--port", str(api_port)]
    command += ["--redis-url", f"redis://127.0.0.1:{redis_port}/0", *args]
    with log_path.open("wb") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def _tiny(tiny_model_path: Path) -> list[str]:
    """One worker on the tiny model, served as ``tiny``."""
    model = ["--model", str(tiny_model_path), "--served-model-name", "tiny"]
    return [*model, "--dtype", "float32", "--max-model-len", "256"]


def _stop_serve(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, so that serve stops its children too; kill only if that hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=45)
        except subprocess.TimeoutExpired:
            process.kill()


def _child(process: subprocess.Popen[bytes], role: str, model: str | None = None) -> psutil.Process:
    """The child running ``relaylm ROLE`` (for ``model``: the worker serve started for it)."""
    children = psutil.Process(process.pid).children()
    return next(
        child
        for child in children
        if f"relaylm {role}" in " ".join(child.cmdline())
        and (model is None or child.environ().get("RELAYLM_MODEL") == model)
    )


def _is_decode_build(process: psutil.Process) -> bool:
    try:
        return "worker.models.compile_decode" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return True  # a build that just ended


def _client(api_port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="x", max_retries=0)


def _chat(api_port: int, model: str = "tiny") -> str | None:
    client = _client(api_port)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    return reply.choices[0].finish_reason


def _embedding_size(api_port: int) -> int:
    reply = _client(api_port).embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input="relaylm serves several models")
    return len(reply.data[0].embedding)


def test_serve_runs_everything_and_ctrl_c_stops_it(tiny_model_path: Path, tmp_path: Path) -> None:
    api_port, redis_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    # --deterministic off: the one configuration that compiles one stream's step (announced below).
    process = _start_serve(log_path, api_port, redis_port, *_tiny(tiny_model_path), "--deterministic", "off")
    try:
        banner = _wait_for(log_path, "relaylm serve: ready — model 'tiny' (generate)", process)
        assert f"redis://127.0.0.1:{redis_port}/0  (started here" in banner
        assert f"http://127.0.0.1:{api_port}/v1" in banner
        children = psutil.Process(process.pid).children(recursive=True)
        # redis-server, worker, API (and, while it runs, the worker's compile of its decode step)
        assert len([child for child in children if not _is_decode_build(child)]) == 3
        assert _chat(api_port) in ("stop", "length")
        if can_compile():  # --compile-decode auto (the default): built in the background, then announced
            _wait_for(log_path, "relaylm serve: one stream's decode step of 'tiny' compiled", process, timeout_s=300)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=45) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        _stop_serve(process)


def test_serve_restarts_a_killed_worker_while_the_api_keeps_serving(tiny_model_path: Path, tmp_path: Path) -> None:
    api_port, redis_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    process = _start_serve(log_path, api_port, redis_port, *_tiny(tiny_model_path))
    try:
        _wait_for(log_path, "relaylm serve: ready", process)
        api, worker = _child(process, "api"), _child(process, "worker")
        worker.send_signal(signal.SIGKILL)
        log = _wait_for(log_path, "relaylm serve: the worker for tiny restarted", process, timeout_s=30)
        reason = "the worker for tiny exited with code -9 (killed by SIGKILL); restarting in 1.0 s (restart 1)"
        assert f"relaylm serve: {reason}" in log
        _wait_for(log_path, "relaylm serve: ready", process, count=2)  # the new worker started
        assert _chat(api_port) in ("stop", "length")
        assert _child(process, "api").pid == api.pid and api.is_running()
        assert _child(process, "worker").pid != worker.pid
        assert "the api exited" not in log_path.read_text(errors="replace")
    finally:
        _stop_serve(process)


@pytest.mark.real_model
def test_serve_without_a_model_serves_chat_and_embeddings_and_restarts_each_worker_alone(
    default_model_path: Path, tmp_path: Path
) -> None:
    """What ``make serve`` runs: the default chat model and the default embedding model, one
    worker each; killing one restarts it while the other keeps its process and serves on."""
    api_port, redis_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    cache_dir = str(default_model_path.parents[1])  # the converted default model the other tests use
    # Light on 2 cores: no self-test of the deterministic numerics and no compiled step to build.
    light = ["--deterministic", "off", "--compile-decode", "off", "--max-model-len", "512"]
    process = _start_serve(log_path, api_port, redis_port, "--cache-dir", cache_dir, *light)
    try:
        log = _wait_for(log_path, "relaylm serve: ready", process, count=2)
        for model in (DEFAULT_MODEL, DEFAULT_EMBEDDING_MODEL):
            assert f"  Worker  model {model}  (pid {_child(process, 'worker', model).pid}; loading…)" in log
        assert f"relaylm serve: ready — model '{DEFAULT_MODEL}' (generate)" in log
        assert f"relaylm serve: ready — model '{DEFAULT_EMBEDDING_MODEL}' (embed)" in log
        tasks = {model.id: (model.model_extra or {})["task"] for model in _client(api_port).models.list().data}
        assert tasks == {DEFAULT_MODEL: "generate", DEFAULT_EMBEDDING_MODEL: "embed"}
        assert _chat(api_port, DEFAULT_MODEL) in ("stop", "length")
        assert _embedding_size(api_port) == 384

        chat_worker = _child(process, "worker", DEFAULT_MODEL)
        _child(process, "worker", DEFAULT_EMBEDDING_MODEL).send_signal(signal.SIGKILL)
        restarted = f"relaylm serve: the worker for {DEFAULT_EMBEDDING_MODEL} restarted"
        log = _wait_for(log_path, restarted, process, timeout_s=30)
        reason = f"the worker for {DEFAULT_EMBEDDING_MODEL} exited with code -9 (killed by SIGKILL)"
        assert f"relaylm serve: {reason}; restarting in 1.0 s (restart 1)" in log
        ready_again = f"relaylm serve: ready — model '{DEFAULT_EMBEDDING_MODEL}' (embed)"
        _wait_for(log_path, ready_again, process, count=2)
        assert _embedding_size(api_port) == 384
        assert _chat(api_port, DEFAULT_MODEL) in ("stop", "length")
        assert _child(process, "worker", DEFAULT_MODEL).pid == chat_worker.pid
        assert f"the worker for {DEFAULT_MODEL} exited" not in log_path.read_text(errors="replace")
    finally:
        _stop_serve(process)


def test_restart_backoff_doubles_to_its_cap_and_resets_after_a_stable_run() -> None:
    backoff = RestartBackoff(first_s=1.0, max_s=30.0, stable_after_s=60.0)
    quick = [backoff.next_delay_s(uptime_s=2.0) for _ in range(7)]
    assert quick == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.next_delay_s(uptime_s=60.0) == 1.0
    assert backoff.next_delay_s(uptime_s=0.5) == 2.0


def test_exit_codes_name_the_signal() -> None:
    assert describe_exit(1) == "code 1"
    assert describe_exit(-signal.SIGKILL) == "code -9 (killed by SIGKILL)"
    assert describe_exit(-signal.SIGSEGV) == "code -11 (killed by SIGSEGV)"
