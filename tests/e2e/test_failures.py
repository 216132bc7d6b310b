"""Failures a client must hear about quickly and clearly: no worker, a dying worker, leaving early."""

from __future__ import annotations

import contextlib
import json
import signal
import time

import httpx
import openai
import pytest

from api.jobs.worker_directory import LIVE_ANSWER_REUSE_S
from tests.conftest import TINY_MODEL
from tests.support.stack import Process, Stack, wait_until

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
LONG = {"max_tokens": 900, "ignore_eos": True}


def _sse_data(line: str) -> str | None:
    return line[len("data: ") :] if line.startswith("data: ") else None


def test_client_disconnect_aborts_the_job(tiny_stack: Stack) -> None:
    worker_id = f"{tiny_stack.key_prefix}-worker0"
    (worker,) = tiny_stack.workers
    body = {"model": TINY_MODEL, "messages": MESSAGES, "stream": True, **LONG}
    with contextlib.ExitStack() as held:
        with httpx.stream("POST", f"{tiny_stack.base_url}/v1/chat/completions", json=body, timeout=30) as response:
            data = (d for d in map(_sse_data, response.iter_lines()) if d is not None)
            next(data)  # the role chunk
            job_id = json.loads(next(data))["id"]  # the first token: the job runs
            # However fast the CPU, the job still runs when the client leaves: the worker is
            # held until the API has cancelled it.
            held.enter_context(worker.paused())
        assert tiny_stack.job_owner(job_id) == worker_id
        wait_until(lambda: tiny_stack.job_state(job_id) == "cancelled", "the API never cancelled the job")
    wait_until(lambda: _logged(worker, job_id, "event=cancelled by=client"), "the worker never stopped the job")
    wait_until(lambda: tiny_stack.worker_info(worker_id).num_running == 0, "the slot was never freed")  # type: ignore[union-attr]
    assert not _logged(worker, job_id, "event=finished")


def _logged(process: Process, job_id: str, text: str) -> bool:
    return any(f"job={job_id} " in line and text in line for line in process.log().splitlines())


def test_unknown_model_is_404_and_known_model_without_worker_is_503(
    fresh_stack: Stack, tiny_model_path: object
) -> None:
    client = fresh_stack.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="never-served", messages=MESSAGES)
    worker = fresh_stack.start_worker(tiny_model_path, "short-lived", dtype="float32", max_model_len=512)
    assert client.chat.completions.create(model="short-lived", messages=MESSAGES, max_tokens=2).choices
    assert worker.stop(signal.SIGTERM) == 0
    # The API reuses its "a worker is live" answer briefly; a request inside that window is queued
    # and fails after --no-worker-grace-s instead (test_worker_killed_while_job_is_queued_gives_503).
    time.sleep(LIVE_ANSWER_REUSE_S + 0.1)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="short-lived", messages=MESSAGES, max_tokens=2)
    assert raised.value.status_code == 503
    assert raised.value.code == "no_live_worker"
    assert time.monotonic() - started < 2.0
    ready = httpx.get(f"{fresh_stack.base_url}/ready", params={"model": "short-lived"})
    assert ready.status_code == 503


def test_worker_killed_mid_stream_ends_with_an_error_event_then_done(
    fresh_stack: Stack, tiny_model_path: object
) -> None:
    worker = fresh_stack.start_worker(tiny_model_path, "doomed", dtype="float32", max_model_len=1024)
    body = {"model": "doomed", "messages": MESSAGES, "stream": True, **LONG}
    events: list[str] = []
    started = time.monotonic()
    with httpx.stream("POST", f"{fresh_stack.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            data = _sse_data(line)
            if data is None:
                continue
            events.append(data)
            if len(events) == 3:
                worker.popen.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "worker_lost"
    # Heartbeat TTL (5 s) plus one liveness check: the client hears within seconds, not minutes.
    assert time.monotonic() - killed_at < 8.0
    assert killed_at - started < 10.0


def test_worker_killed_while_job_is_queued_gives_503(fresh_stack: Stack, tiny_model_path: object) -> None:
    worker = fresh_stack.start_worker(tiny_model_path, "gone", dtype="float32", max_model_len=512)
    worker.popen.send_signal(signal.SIGKILL)
    worker.popen.wait()
    # The registry still shows the worker until its heartbeat expires; the job is queued, then
    # the API notices no live worker remains and answers 503 instead of hanging.
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as raised:
        fresh_stack.client(timeout=30).chat.completions.create(model="gone", messages=MESSAGES, max_tokens=2)
    assert raised.value.status_code == 503
    assert time.monotonic() - started < 12.0
