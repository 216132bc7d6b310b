"""SIGTERM to an API process drains it: new requests get 503 ``server_shutting_down`` with
Retry-After and ``Connection: close``, ``/health`` still answers and ``/ready`` does not, open
streams finish whole, and then the process exits."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_stack
from tests.support.stack import Stack

pytestmark = pytest.mark.slow
MODEL = "drain-tiny"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me everything"}],
    "max_tokens": 300,
    "temperature": 0,
    "ignore_eos": True,
}


def _data(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[6:]


def _text(data: list[str]) -> str:
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def _wait_until_draining(base_url: str, timeout_s: float = 10.0) -> None:
    """The signal is handled asynchronously; a cheap GET shows when the drain has begun."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 503:
            return
        time.sleep(0.05)
    raise AssertionError("the API never started draining")


def test_a_draining_api_refuses_new_requests_and_lets_open_streams_finish(
    fresh_stack: Stack, tiny_model_path: Path
) -> None:
    worker = fresh_stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024)
    api = fresh_stack.api
    assert api is not None
    url = f"{fresh_stack.base_url}/v1/chat/completions"
    expected = httpx.post(url, json=BODY, timeout=60).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", url, json={**BODY, "stream": True}, timeout=60) as response:
        data = _data(response.iter_lines())
        first = [next(data), next(data)]  # the role chunk, then the first token
        # The tiny model could finish 300 tokens before the checks below ran: hold the worker
        # (its heartbeat outlives the pause) so that the stream is surely still open.
        worker.popen.send_signal(signal.SIGSTOP)
        try:
            api.popen.send_signal(signal.SIGTERM)
            _wait_until_draining(fresh_stack.base_url)
            refused = httpx.post(url, json={**BODY, "max_tokens": 2}, timeout=10)  # a new connection
            health = httpx.get(f"{fresh_stack.base_url}/health", timeout=5)
            ready = httpx.get(f"{fresh_stack.base_url}/ready", timeout=5)
            assert api.is_running()  # waiting for the open stream
        finally:
            worker.popen.send_signal(signal.SIGCONT)
        rest = list(data)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "2"  # --retry-after-s's default
    assert refused.headers["connection"] == "close"
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("service_unavailable_error", None, "server_shutting_down")
    assert health.status_code == 200
    assert ready.status_code == 503
    assert rest[-1] == "[DONE]" and not any(d.startswith('{"error"') for d in rest)
    assert _text(first + rest) == expected
    # uvicorn raises the signal again once it has shut down, so the status may report SIGTERM.
    assert api.popen.wait(timeout=30) in (0, -signal.SIGTERM)
    log = api.log()
    assert "draining: new requests get 503" in log and "Finished server process" in log


def test_a_second_sigterm_stops_a_draining_api_at_once(fresh_stack: Stack, tiny_model_path: Path) -> None:
    worker = fresh_stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024)
    api = fresh_stack.api
    assert api is not None
    url = f"{fresh_stack.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**BODY, "stream": True}, timeout=60) as response:
        data = _data(response.iter_lines())
        next(data)
        worker.popen.send_signal(signal.SIGSTOP)  # the stream stays open: only a forced exit ends it
        try:
            api.popen.send_signal(signal.SIGTERM)
            _wait_until_draining(fresh_stack.base_url)
            api.popen.send_signal(signal.SIGTERM)
            assert api.popen.wait(timeout=5) in (0, -signal.SIGTERM)
        finally:
            worker.popen.send_signal(signal.SIGCONT)


def test_a_drain_ends_when_its_window_has_passed(redis_url: str, log_dir: Path, tiny_model_path: Path) -> None:
    stack = make_stack(redis_url, log_dir)
    try:
        api = stack.start_api(drain_timeout_s=1)
        worker = stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024)
        url = f"{stack.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json={**BODY, "stream": True}, timeout=60) as response:
            data = _data(response.iter_lines())
            next(data)
            worker.popen.send_signal(signal.SIGSTOP)  # a stream that cannot finish in the window
            try:
                signalled_at = time.monotonic()
                api.popen.send_signal(signal.SIGTERM)
                assert api.popen.wait(timeout=15) in (0, -signal.SIGTERM)
                # The open stream held the drain for its whole window (an idle API ends it at once).
                assert time.monotonic() - signalled_at >= 1.0
            finally:
                worker.popen.send_signal(signal.SIGCONT)
        # At the window's end sse-starlette's grace (the same length) cuts the stream while the drain
        # check, every 0.1 s, ends the server: which comes first decides whether it counts 1 or 0.
        assert re.search(r"drained \([01] request\(s\) still in flight\)", api.log())
    finally:
        stack.stop()
