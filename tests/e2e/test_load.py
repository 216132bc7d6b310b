"""200 concurrent streams, every delta checked by sequence number; then overload past the queue
limit: only 429s, no 5xx, no hung connection. (The 1,000-stream version is bench/load_test.py.)"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_stack
from tests.support.sse_load import run_load
from tests.support.stack import Stack, wait_until

pytestmark = pytest.mark.slow
MODEL = "load-tiny"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "go"}],
    "max_tokens": 16,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def load_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(max_pending_per_model=120, log_level="WARNING")
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=128, max_num_seqs=128)
        yield stack
    finally:
        stack.stop()


def test_200_streams_lose_and_repeat_nothing(load_stack: Stack) -> None:
    # 200 clients, but the queue admits 120 at a time: the rest back off on 429 and come again.
    # Each client makes 3 requests at most; the deadline only bounds a host too slow for that.
    tally = asyncio.run(run_load(load_stack.base_url, BODY, num_clients=200, duration_s=120, max_requests_per_client=3))
    assert tally.completed_streams >= 200
    assert tally.lost == 0 and tally.duplicated == 0
    assert tally.deltas >= 200 * 16
    assert tally.server_errors == 0 and not tally.errors
    assert set(tally.statuses) <= {200, 429}


def test_overload_gets_only_429s_and_nothing_hangs(load_stack: Stack) -> None:
    # The worker is held until the queue has turned a request away: however fast the engine, it
    # cannot keep the queue under its limit while the 400 requests come in.
    (worker,) = load_stack.workers
    load = run_load(
        load_stack.base_url, BODY, num_clients=400, duration_s=30, max_requests_per_client=1, request_timeout_s=30
    )
    with ThreadPoolExecutor(1) as pool:
        with worker.paused():
            running = pool.submit(asyncio.run, load)
            wait_until(lambda: _num_refused(load_stack) > 0, "the queue never turned a request away")
        tally = running.result()
    assert tally.requests == 400
    assert tally.statuses[429] > 0
    assert set(tally.statuses) == {200, 429}
    assert tally.completed_streams == tally.statuses[200]  # every admitted stream ended with [DONE]
    assert not tally.errors  # no timeouts, no stream errors


def _num_refused(stack: Stack) -> float:
    """Requests the API answered 429 because the model's queue was full."""
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "relaylm:request_failure_total" and sample.labels.get("code") == "queue_full"
    )


def test_an_idle_keep_alive_connection_outlives_the_client_pool_expiry(load_stack: Stack) -> None:
    # httpx (and so the openai client) reuses a pooled connection for up to 5 s; a server that closes
    # idle ones at the same 5 s races it and resets a request now and then (seen as httpx.ReadError).
    with socket.create_connection(("127.0.0.1", load_stack.port), timeout=10) as conn:
        request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{load_stack.port}\r\n\r\n".encode()
        conn.sendall(request)
        assert _read_response(conn).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)
        conn.sendall(request)
        assert _read_response(conn).startswith(b"HTTP/1.1 200")  # with a 5 s keep-alive: b"" (closed)


def _read_response(conn: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (headers, then Content-Length bytes); b"" if the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += conn.recv(4096)
    return data
