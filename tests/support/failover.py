"""What every Redis failover test checks, under Sentinel and under Cluster: a stream, a 500-line
batch and a background response run while the primary is killed or frozen and a replica is
promoted; the stream ends with its complete text, byte for byte the text of an undisturbed run of
the same greedy request, with no error, within 5 s of its job's end; every batch line ends
exactly once; no job stays in progress past its lease plus 15 s; a frozen primary, thawed, keeps
no connection of ours. A stream whose job the failover lost ends with an error and ``[DONE]``
within 15 s of the promotion.

The worker is held (SIGSTOP) from before the fault until just after it, so the stream is surely
open when the primary goes, whatever the engine's speed: what it generates meanwhile waits in its
outbox for the new primary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import openai
import psutil
import redis
from openai.types.chat import ChatCompletion

from shared.redis_keys import WORKER_HEARTBEAT_TTL_S
from tests.support.batches import submit_batch
from tests.support.redis_sentinel import Server
from tests.support.stack import Stack, free_port

MODEL = "failover-tiny"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "temperature": 0, "ignore_eos": True}
STREAM_TOKENS = 700
BATCH_LINES = 500
PROMOTION_TO_END_S = 15.0
JOB_END_TO_STREAM_END_S = 5.0


class Replicated(Protocol):
    """A primary with a replica that takes over: a Sentinel group, or one shard of a cluster."""

    def primary(self) -> Server: ...

    def wait_promotion(self, old_port: int, timeout_s: float = 30.0) -> float: ...

    def wait_replica_of(self, server: Server, primary_port: int, timeout_s: float = 30.0) -> None: ...


@dataclass
class _Stream:
    """One streaming chat on a thread: its ``data:`` payloads and when it ended."""

    base_url: str
    data: list[str] = field(default_factory=list)
    ended_at: float = 0.0
    ended_wall: float = 0.0  # time.time(), to compare with the job record's times
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
        self.ended_at, self.ended_wall = time.monotonic(), time.time()

    def text(self) -> str:
        chunks = [json.loads(d) for d in self.data if d != "[DONE]"]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))

    def error_code(self) -> str | None:
        last = json.loads(self.data[-2]) if len(self.data) >= 2 else {}
        return last.get("error", {}).get("code") if isinstance(last, dict) else None

    def job_id(self) -> str:
        return str(json.loads(self.data[0])["id"])

    def wait_open(self, num_chunks: int, timeout_s: float = 60) -> None:
        """Until ``num_chunks`` data lines arrived (the stream must still be open then)."""
        deadline = time.monotonic() + timeout_s
        while len(self.data) < num_chunks:
            assert time.monotonic() < deadline, self.data[-3:]
            assert self.failure is None, self.failure
            time.sleep(0.02)


def chat(client: openai.OpenAI, max_tokens: int) -> ChatCompletion:
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


def _finished_at(url: str, stack: Stack, job_id: str) -> float:
    """When the job's final event was written (its record's last update, wall clock)."""
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        state, updated_ms = client.hmget(stack.keys.job(job_id), ["state", "updated_ms"])
    finally:
        client.close()
    assert state == b"finished", state
    return int(updated_ms) / 1000


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


def run_failover(stack: Stack, group: Replicated, fault: int) -> None:
    """Stream, batch and background response running; the primary gets ``fault``; then the
    checks every failover must pass. A frozen primary is thawed once a replica took over."""
    client = stack.client()
    expected = chat(client, STREAM_TOKENS)
    expected_text = expected.choices[0].message.content
    batch_id = _submit_batch(stack.base_url)
    background = client.responses.create(model=MODEL, input="go on", background=True, max_output_tokens=300)
    deadline = time.monotonic() + 60
    while _completed(_batch(stack.base_url, batch_id)) < 10:
        assert time.monotonic() < deadline, _batch(stack.base_url, batch_id)
        time.sleep(0.1)
    stream = _Stream(stack.base_url)
    thread = stream.start()
    stream.wait_open(20)

    old = _fault_with_the_stream_open(stack, group, stream, fault)
    group.wait_promotion(old.port)
    if fault == signal.SIGSTOP:
        old.signal(signal.SIGCONT)
    new_primary = f"redis://127.0.0.1:{group.primary().port}/0"
    stack.redis_url = new_primary

    thread.join(timeout=180)
    assert stream.failure is None, stream.failure
    assert stream.data and stream.data[-1] == "[DONE]", stream.data[-3:]
    assert stream.error_code() is None, stream.data[-3:]
    assert stream.text() == expected_text
    # How soon it ends depends on the engine; what the failover must not add is a lag behind the job.
    lag_s = stream.ended_wall - _finished_at(new_primary, stack, stream.job_id())
    assert lag_s < JOB_END_TO_STREAM_END_S, lag_s

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

    # The service goes on: a new request, a new stream, on the new primary (asked as the SDK's
    # default client asks: a 503 says "try again shortly", and it does).
    after = chat(stack.client(max_retries=2), 8)
    assert after.choices[0].message.content

    if fault == signal.SIGSTOP:
        group.wait_replica_of(old, group.primary().port)
        deadline = time.monotonic() + 15
        while _our_clients(old) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _our_clients(old) == []


def _fault_with_the_stream_open(stack: Stack, group: Replicated, stream: _Stream, fault: int) -> Server:
    """The primary gets ``fault`` while the worker is held, so the stream is open across it;
    the worker goes on at once (its events wait for the new primary). Returns the old primary."""
    [worker] = stack.workers
    old = group.primary()
    worker.popen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.2)  # the events already on their way arrive
        assert stream.ended_at == 0 and "[DONE]" not in stream.data, "the stream ended before the fault"
        old.signal(fault)
    finally:
        worker.popen.send_signal(signal.SIGCONT)
    return old


def run_lost_job(stack: Stack, group: Replicated) -> None:
    """The primary is killed mid-stream and the promoted replica lacks the job (its record and
    log deleted there: what a failover loses when the job's writes had not reached the replica).
    The stream ends with an error event and ``[DONE]`` within 15 s of the promotion, never hangs."""
    stream = _Stream(stack.base_url)
    thread = stream.start()
    stream.wait_open(20)
    [worker] = stack.workers
    old = group.primary()
    worker.popen.send_signal(signal.SIGSTOP)  # until the job is gone: it must not finish first
    try:
        old.signal(signal.SIGKILL)
        promoted_at = group.wait_promotion(old.port)
        new_primary = group.primary().client()
        try:
            job_id = stream.job_id()
            assert new_primary.delete(stack.keys.job(job_id), stack.keys.job_event_log(job_id)) >= 1
        finally:
            new_primary.close()
    finally:
        worker.popen.send_signal(signal.SIGCONT)
    thread.join(timeout=60)
    assert stream.failure is None, stream.failure
    assert stream.data and stream.data[-1] == "[DONE]", stream.data[-3:]
    assert stream.error_code() == "internal_error", stream.data[-3:]
    assert "failover lost it" in json.loads(stream.data[-2])["error"]["message"]
    assert stream.ended_at - promoted_at < PROMOTION_TO_END_S, stream.ended_at - promoted_at


def serve_and_chat(topology: list[str], tmp_path: Path, tiny_model_path: Path) -> str:
    """``relaylm serve`` with the ``topology`` flags (the URL's host is a port nobody listens on):
    it serves a chat and starts no Redis of its own. Returns what it printed."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYLM_") and k != "REDIS_URL"}
    command = [
        sys.executable, "-m", "relaylm", "serve", "--port", str(port), "--redis-url",
        f"redis://127.0.0.1:{free_port()}/0", *topology, "--model", str(tiny_model_path), "--served-model-name", MODEL,
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
        assert chat(client, 4).choices[0].message.content
        children = " ".join(" ".join(c.cmdline()) for c in psutil.Process(serve.pid).children(recursive=True))
        assert "redis-server" not in children
        return log_path.read_text()
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=45)
        except subprocess.TimeoutExpired:
            serve.kill()
