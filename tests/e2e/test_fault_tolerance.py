"""Workers and API processes fail independently: takeover from the tokens already sent, resumable
streams, Redis restarts, and draining on SIGTERM — all with real processes and a real Redis."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from relaylm.redis_launcher import find_redis_server, start_redis
from tests.conftest import make_stack
from tests.e2e.conftest import TWO_WORKER_MODEL
from tests.support.stack import START_TIMEOUT_S, Stack, free_port, wait_until

pytestmark = pytest.mark.slow
MODEL = TWO_WORKER_MODEL
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me everything"}],
    "temperature": 0,
    "ignore_eos": True,
}


def _events(response: httpx.Response) -> Iterator[tuple[int | None, str]]:
    """(SSE id, data) pairs of a streaming response."""
    event_id: int | None = None
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            yield event_id, line[6:]
            event_id = None


def _text(data: list[str]) -> str:
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def stream_killing_its_worker(stack: Stack, body: dict[str, object], after: int = 5) -> list[str]:
    """A chat stream's data lines, its worker SIGKILLed after the ``after``-th (another continues it)."""
    data: list[str] = []
    with httpx.stream(
        "POST", f"{stack.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        for _, payload in _events(response):
            data.append(payload)
            if len(data) == after:
                stack.worker_of(json.loads(payload)["id"]).popen.send_signal(signal.SIGKILL)
    return data


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1234}], ids=["greedy", "seeded"])
def test_a_killed_workers_stream_continues_on_the_other_without_gap_or_repeat(
    two_workers: Stack, sampling: dict[str, object]
) -> None:
    """The text after the SIGKILL is byte-identical to the undisturbed text (bf16, --deterministic
    on): the other worker recomputes the prompt and the tokens already sent in one prefill, with
    the bits the first worker's decode steps had, and draws from the resumed position on."""
    body = {**BODY, **sampling, "max_tokens": 700, "stream": True}
    undisturbed = httpx.post(f"{two_workers.base_url}/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    expected = undisturbed.json()["choices"][0]["message"]["content"]
    ids, data, killed_at, resumed_at = [], [], 0.0, 0.0
    with httpx.stream("POST", f"{two_workers.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        for event_id, payload in _events(response):
            ids.append(event_id)
            data.append(payload)
            if len(data) == 5:
                job_id = json.loads(payload)["id"]
                victim = two_workers.worker_of(job_id)
                victim.popen.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
            elif killed_at and not resumed_at:
                resumed_at = time.monotonic()
    assert data[-1] == "[DONE]"
    assert not any('"error"' in d[:10] for d in data)
    seqs = [i for i in ids if i is not None]
    assert seqs[1:] == list(range(1, len(seqs)))  # role chunk 0, then every event once, in order
    assert _text(data) == expected
    assert resumed_at - killed_at < 10.0
    assert "event=picked" in two_workers.workers[1 - two_workers.workers.index(victim)].log()
    assert "attempt=2" in "".join(w.log() for w in two_workers.workers)


def test_a_resumable_stream_can_be_picked_up_again_with_last_event_id(two_workers: Stack) -> None:
    body = {**BODY, "max_tokens": 300, "stream": True, "resumable": True}
    expected = httpx.post(f"{two_workers.base_url}/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    first_part: list[str] = []
    last_id = 0
    with httpx.stream("POST", f"{two_workers.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        for event_id, payload in _events(response):
            first_part.append(payload)
            last_id = event_id if event_id is not None else last_id
            if len(first_part) == 4:
                job_id = json.loads(payload)["id"]
                break  # the client drops the connection
    url = f"{two_workers.base_url}/v1/chat/completions/{job_id}/stream"
    with httpx.stream("GET", url, headers={"Last-Event-ID": str(last_id)}, timeout=60) as response:
        assert response.status_code == 200
        rest = list(_events(response))
    assert rest[0][0] == last_id + 1
    assert rest[-1][1] == "[DONE]"
    assert _text(first_part) + _text([d for _, d in rest]) == expected.json()["choices"][0]["message"]["content"]
    missing = httpx.get(f"{two_workers.base_url}/v1/chat/completions/chatcmpl-nope/stream")
    assert missing.status_code == 404


def test_sigterm_drains_a_worker_and_the_api_lets_open_streams_finish(two_workers: Stack) -> None:
    body = {**BODY, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{two_workers.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        events = _events(response)
        _, first = next(events)
        job_id = json.loads(first)["id"]
        worker = two_workers.worker_of(job_id)
        assert two_workers.api is not None
        # However fast the CPU, the stream is still open when both processes are told to stop:
        # its worker is held until the API has begun draining.
        with worker.paused():
            worker.popen.send_signal(signal.SIGTERM)
            two_workers.api.popen.send_signal(signal.SIGTERM)
            wait_until(lambda: _is_draining(two_workers.base_url), "the API never began draining")
        rest = [data for _, data in events]
    assert rest[-1] == "[DONE]" and not any(d.startswith('{"error"') for d in rest)
    assert worker.popen.wait(timeout=30) == 0
    # uvicorn re-raises the signal once it has shut down gracefully, so the status reports SIGTERM.
    try:
        status = two_workers.api.popen.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the API did not exit within 30 s of its drain; its log ends:\n{two_workers.api.log()[-4000:]}")
    assert status in (0, -signal.SIGTERM)
    assert "Finished server process" in two_workers.api.log()
    assert "draining" in worker.log()


def _is_draining(base_url: str) -> bool:
    """A draining API answers a new request 503 (the signal is handled asynchronously)."""
    return httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 503


def test_two_workers_share_the_load(redis_url: str, log_dir: Path, tiny_model_path: Path) -> None:
    """Workers that do not pool (each with its own thread count, as on hosts of their own) both
    take jobs; two default workers on the same cores pool instead (tests/e2e/test_host_pool.py)."""
    import asyncio

    from tests.support.sse_load import run_load

    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        for _ in range(2):
            stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024, num_threads=1)
        tally = asyncio.run(run_load(stack.base_url, {**BODY, "max_tokens": 40, "stream": True}, 16, 30, 1))
        assert tally.completed_streams == 16
        picked = [w.log().count("event=picked") for w in stack.workers]
        assert all(count > 0 for count in picked), picked
    finally:
        stack.stop()


def test_requests_are_routed_by_model(redis_url: str, log_dir: Path, tiny_model_path: Path) -> None:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        stack.start_worker(tiny_model_path, "model-a", dtype="float32", max_model_len=256)
        stack.start_worker(tiny_model_path, "model-b", dtype="float32", max_model_len=256)
        for model, worker in (("model-a", 0), ("model-b", 1)):
            reply = stack.client().chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            assert reply.model == model
            assert f"job={reply.id}" in stack.workers[worker].log()
            assert f"job={reply.id}" not in stack.workers[1 - worker].log()
    finally:
        stack.stop()


@pytest.fixture
def own_redis(log_dir: Path) -> Iterator[tuple[str, int, str]]:
    binary = find_redis_server()
    assert binary is not None
    handle = start_redis(binary, port=free_port())
    try:
        yield handle.url, int(handle.url.rsplit(":", 1)[1].split("/")[0]), binary
    finally:
        handle.stop()


def test_a_redis_restart_ends_open_streams_with_an_error_and_everything_reconnects(
    own_redis: tuple[str, int, str], log_dir: Path, tiny_model_path: Path
) -> None:
    url, port, binary = own_redis
    stack = make_stack(url, log_dir)
    restarted: subprocess.Popen[bytes] | None = None
    try:
        stack.start_api()
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024)
        body = {**BODY, "max_tokens": 900, "stream": True}
        data: list[str] = []
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            for _, payload in _events(response):
                data.append(payload)
                if len(data) == 3:
                    redis.Redis.from_url(url).shutdown(nosave=True)
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] in ("redis_unavailable", "stream_gap", "worker_lost")
        started = time.monotonic()
        down = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**BODY, "max_tokens": 2}, timeout=30)
        assert down.status_code == 503 and time.monotonic() - started < 5
        restarted = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reply = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**BODY, "max_tokens": 2}, timeout=30)
            if reply.status_code == 200:
                break
            time.sleep(0.5)
        assert reply.status_code == 200, reply.text
        assert stack.workers[0].is_running()
    finally:
        stack.stop()
        if restarted is not None:
            restarted.terminate()
            restarted.wait(timeout=10)


def test_when_the_api_dies_the_client_reconnects_through_another_api(two_workers: Stack) -> None:
    body = {**BODY, "max_tokens": 400, "stream": True}
    expected = httpx.post(f"{two_workers.base_url}/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    first_part: list[str] = []
    last_id = 0
    assert two_workers.api is not None
    url = f"{two_workers.base_url}/v1/chat/completions"
    # The connection dies under the reader.
    with pytest.raises(httpx.HTTPError), httpx.stream("POST", url, json=body, timeout=60) as response:
        for event_id, payload in _events(response):
            first_part.append(payload)
            last_id = event_id if event_id is not None else last_id
            if len(first_part) == 4:
                job_id = json.loads(payload)["id"]
                two_workers.api.popen.send_signal(signal.SIGKILL)
    two_workers.api.popen.wait()
    two_workers.start_api()  # a fresh API process on the same address
    url = f"{two_workers.base_url}/v1/chat/completions/{job_id}/stream"
    with httpx.stream("GET", url, headers={"Last-Event-ID": str(last_id)}, timeout=60) as response:
        rest = [data for _, data in _events(response)]
    assert rest[-1] == "[DONE]"
    assert _text(first_part) + _text(rest) == expected.json()["choices"][0]["message"]["content"]


def test_a_worker_started_before_redis_waits_for_it_then_serves(log_dir: Path, tiny_model_path: Path) -> None:
    binary = find_redis_server()
    assert binary is not None
    port = free_port()
    stack = make_stack(f"redis://127.0.0.1:{port}/0", log_dir)
    handle = None
    try:
        worker = stack.start_worker(tiny_model_path, MODEL, wait=False, dtype="float32", max_model_len=256)
        wait_until(lambda: "does not answer" in worker.log(), "no word that Redis does not answer", START_TIMEOUT_S)
        assert worker.is_running()
        handle = start_redis(binary, port=port)
        stack.start_api()
        stack.wait_ready(worker, MODEL)
        reply = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        stack.stop()
        if handle is not None:
            handle.stop()


def test_a_worker_that_redis_refuses_exits_at_once_with_the_reason(
    own_redis: tuple[str, int, str], log_dir: Path, tiny_model_path: Path
) -> None:
    url, port, _ = own_redis
    admin = redis.Redis.from_url(url)
    admin.config_set("requirepass", "right-password")
    admin.close()
    stack = make_stack(f"redis://:wrong-password@127.0.0.1:{port}/0", log_dir)
    worker = stack.start_worker(tiny_model_path, MODEL, wait=False, dtype="float32")
    assert worker.popen.wait(timeout=START_TIMEOUT_S) != 0  # before it loads the model: its imports are the wait
    log = worker.log()
    assert "refused the connection" in log and "wrong-password" not in log
    assert "Traceback" not in log
