"""Fault injection: real Redis, API and worker processes, killed, paused and restarted under
load. Under each fault every stream ends with its complete text, or with an OpenAI-shaped error
event and ``[DONE]``, within 10 s of the fault (a frozen Redis: of its thaw); every batch line
ends exactly once; no process writes to a job it does not own.

The numbers in the test names are the fault cases; the "What survives what" table in
docs/operations.md quotes what these tests measure.
"""

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

from relaylm.redis_launcher import find_redis_server
from shared.redis_keys import WORKER_HEARTBEAT_TTL_S
from tests.conftest import make_stack
from tests.e2e.conftest import TWO_WORKER_MODEL
from tests.support.batches import submit_batch
from tests.support.stack import Stack, free_port, wait_until

pytestmark = pytest.mark.slow
MODEL = TWO_WORKER_MODEL
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "temperature": 0, "ignore_eos": True}


def _stream(url: str, body: dict[str, object], on_data: object = None, timeout_s: float = 60) -> list[str]:
    """The ``data:`` payloads of one streaming request; ``on_data(n, payload)`` after each."""
    data: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout_s) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
                if on_data is not None:
                    on_data(len(data), data[-1])  # type: ignore[operator]
    return data


def _text(data: list[str]) -> str:
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def _expected(url: str, max_tokens: int) -> str:
    reply = httpx.post(f"{url}/v1/chat/completions", json={**BODY, "max_tokens": max_tokens}, timeout=60)
    return str(reply.json()["choices"][0]["message"]["content"])


class _OwnRedis:
    """A Redis of the test's own, to stop, freeze and restart (on the same port and data dir)."""

    def __init__(self, workdir: Path, appendonly: bool) -> None:
        binary = find_redis_server()
        assert binary is not None
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._command = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir),
            "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise TimeoutError("redis did not start")

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[_OwnRedis]:
    handle = _OwnRedis(tmp_path, appendonly=True)
    try:
        yield handle
    finally:
        handle.stop()


def _log_seqs(stack: Stack, job_id: str) -> list[int]:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        entries = client.xrange(stack.keys.job_event_log(job_id))
    finally:
        client.close()
    return [int(entry_id.decode().split("-")[0]) for entry_id, _ in entries]


def _submit_batch(base_url: str, num_lines: int, max_tokens: int = 40) -> str:
    return submit_batch(base_url, [{**BODY, "max_tokens": max_tokens + i % 7} for i in range(num_lines)])


def _wait_completed(base_url: str, batch_id: str, at_least: int, timeout_s: float) -> dict[str, object]:
    """The batch once ``at_least`` lines completed (or it ended); {} while the API does not answer."""
    deadline = time.monotonic() + timeout_s
    current: dict[str, object] = {}
    while time.monotonic() < deadline:
        try:
            current = httpx.get(f"{base_url}/v1/batches/{batch_id}", timeout=5).json()
        except httpx.HTTPError:
            current = {}
        counts = current.get("request_counts")
        completed = counts.get("completed", 0) if isinstance(counts, dict) else 0
        if current.get("status") in ("completed", "failed") or completed >= at_least:
            return current
        time.sleep(0.2)
    return current


def _each_line_once(base_url: str, batch: dict[str, object], num_lines: int) -> tuple[list[str], list[str]]:
    """The batch's output and error lines, after checking every custom_id is in them exactly once."""
    output = httpx.get(f"{base_url}/v1/files/{batch['output_file_id']}/content").text.splitlines()
    errors: list[str] = []
    if batch.get("error_file_id"):
        errors = httpx.get(f"{base_url}/v1/files/{batch['error_file_id']}/content").text.splitlines()
    custom_ids = [json.loads(line)["custom_id"] for line in output + errors]
    assert sorted(custom_ids) == sorted(f"line-{i}" for i in range(num_lines))
    return output, errors


def _served_tokens(url: str, stack: Stack) -> int:
    """The tokens the batch lane served (the one tenant of a server without keys)."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.hget(f"{stack.keys.batch_queue(MODEL)}:fair", "served:") or 0)
    finally:
        client.close()


def test_1_redis_restarted_with_appendonly_while_a_batch_runs_ends_every_line_once(
    own_redis: _OwnRedis, log_dir: Path, tiny_model_path: Path
) -> None:
    stack = make_stack(own_redis.url, log_dir)
    try:
        # At most 8 lines in flight, 8 more each 0.2 s advance: the batch takes 8 advances or more
        # however fast the engine, so Redis goes down while it runs.
        stack.start_api(batch_poll_interval_s=0.2, batch_concurrency=8)
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=512)
        batch_id = _submit_batch(stack.base_url, 60)
        midway = _wait_completed(stack.base_url, batch_id, at_least=10, timeout_s=120)
        assert midway.get("status") == "in_progress", midway
        served_before = _served_tokens(own_redis.url, stack)
        own_redis.kill()
        time.sleep(1.0)
        own_redis.start()
        current = _wait_completed(stack.base_url, batch_id, at_least=61, timeout_s=90)
        assert current.get("status") == "completed", current
        output, errors = _each_line_once(stack.base_url, current, 60)
        assert len(output) >= 55, errors[:3]
        client = redis.Redis.from_url(own_redis.url)
        assert client.zcard(stack.keys.running_jobs()) == 0
        client.close()
        # The fair share's counters came back with the rest of the job state, and kept counting.
        assert served_before > 0 and _served_tokens(own_redis.url, stack) > served_before
    finally:
        stack.stop()


def test_1_redis_restarted_without_persistence_loses_the_batch_with_a_404_and_serves_again(
    tmp_path: Path, log_dir: Path, tiny_model_path: Path
) -> None:
    # Without appendonly a restarted Redis is empty: the batch, its files and queued jobs are gone.
    # What a client gets then is a clear 404 (never a 500 or a hang), and the stack serves again
    # with no process restarted: workers re-register from their heartbeats.
    volatile = _OwnRedis(tmp_path, appendonly=False)
    stack = make_stack(volatile.url, log_dir)
    try:
        stack.start_api(batch_poll_interval_s=0.2)
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=512)
        batch_id = _submit_batch(stack.base_url, 30)
        _wait_completed(stack.base_url, batch_id, at_least=5, timeout_s=60)
        served_before = _served_tokens(volatile.url, stack)
        volatile.kill()
        volatile.start()
        restarted = time.monotonic()
        reply = httpx.get(f"{stack.base_url}/v1/batches/{batch_id}", timeout=10)
        while reply.status_code == 503 and time.monotonic() - restarted < 10:
            time.sleep(0.2)
            reply = httpx.get(f"{stack.base_url}/v1/batches/{batch_id}", timeout=10)
        assert reply.status_code == 404, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"
        while time.monotonic() - restarted < 20:
            served = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**BODY, "max_tokens": 3}, timeout=10)
            if served.status_code == 200:
                break
            time.sleep(0.2)
        assert served.status_code == 200, served.text
        assert time.monotonic() - restarted < 15
        new_batch = _wait_completed(stack.base_url, _submit_batch(stack.base_url, 4), at_least=5, timeout_s=60)
        assert new_batch.get("status") == "completed", new_batch
        # The fair share starts level again: its counters restarted from nothing with the new lines.
        assert 0 < _served_tokens(volatile.url, stack) < served_before  # 4 lines now, 5 or more before
        _each_line_once(stack.base_url, new_batch, 4)
    finally:
        stack.stop()
        volatile.stop()


def test_a_killed_workers_batch_lines_leave_it_within_the_lease_and_end_once(two_workers: Stack) -> None:
    # A running job whose owner is gone is requeued within its lease (the heartbeat TTL) plus 10 s.
    batch_id = _submit_batch(two_workers.base_url, 40, max_tokens=200)
    victim_id = _owner_of_a_running_line(two_workers)
    victim = two_workers.workers[int(victim_id.rsplit("worker", 1)[1])]
    victim.popen.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for worker in two_workers.workers:
        worker.popen.send_signal(signal.SIGCONT)
    while victim_id in two_workers.running_jobs().values() and time.monotonic() - killed_at < 30:
        time.sleep(0.2)
    released_after_s = time.monotonic() - killed_at
    assert victim_id not in two_workers.running_jobs().values()
    assert released_after_s < WORKER_HEARTBEAT_TTL_S + 10, released_after_s
    current = _wait_completed(two_workers.base_url, batch_id, at_least=41, timeout_s=120)
    assert current.get("status") == "completed", current
    output, errors = _each_line_once(two_workers.base_url, current, 40)
    assert not errors and len(output) == 40


def _owner_of_a_running_line(stack: Stack) -> str:
    """A worker that holds a running job, returned with every worker stopped (SIGSTOP), so that
    the job is still running when the test acts on it however fast the engine is; the caller
    continues them."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if stack.running_jobs():
            for worker in stack.workers:
                worker.popen.send_signal(signal.SIGSTOP)
            running = stack.running_jobs()  # nothing ends while they are stopped
            if running:
                return next(iter(running.values()))
            for worker in stack.workers:
                worker.popen.send_signal(signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError("no batch line ever ran")


def test_2_a_frozen_redis_gets_503_with_retry_after_and_the_api_recovers_on_thaw(
    own_redis: _OwnRedis, log_dir: Path, tiny_model_path: Path
) -> None:
    stack = make_stack(own_redis.url, log_dir)
    try:
        stack.start_api()
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=512)
        own_redis.signal(signal.SIGSTOP)
        try:
            for method, path, body in (
                ("GET", "/v1/models", None),
                ("GET", "/ready", None),
                ("POST", "/v1/chat/completions", {**BODY, "max_tokens": 2}),
            ):
                started = time.monotonic()
                reply = httpx.request(method, f"{stack.base_url}{path}", json=body, timeout=30)
                assert reply.status_code == 503, (path, reply.text)
                assert time.monotonic() - started < 6, path
                if path != "/ready":
                    assert reply.headers["retry-after"]
                    assert reply.json()["error"]["code"] == "redis_unavailable"
        finally:
            own_redis.signal(signal.SIGCONT)
        thawed = time.monotonic()
        while time.monotonic() - thawed < 10:
            reply = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**BODY, "max_tokens": 2}, timeout=10)
            if reply.status_code == 200:
                break
            time.sleep(0.2)
        assert reply.status_code == 200, reply.text
    finally:
        stack.stop()


def test_2_a_stream_open_while_redis_freezes_ends_with_an_error_then_done(
    own_redis: _OwnRedis, log_dir: Path, tiny_model_path: Path
) -> None:
    stack = make_stack(own_redis.url, log_dir)
    try:
        stack.start_api()
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024)
        frozen_at: list[float] = []

        def freeze(count: int, _payload: str) -> None:
            if count == 3:
                own_redis.signal(signal.SIGSTOP)
                frozen_at.append(time.monotonic())

        try:
            data = _stream(stack.base_url, {**BODY, "max_tokens": 900, "stream": True}, freeze)
        finally:
            own_redis.signal(signal.SIGCONT)
        assert data[-1] == "[DONE]"
        if _text(data) and len(data) < 900:
            assert json.loads(data[-2])["error"]["code"] in ("redis_unavailable", "stream_gap")
        assert time.monotonic() - frozen_at[0] < 10
    finally:
        stack.stop()


def test_3_a_worker_back_with_the_same_id_does_not_inherit_the_dead_ones_stream(
    two_workers: Stack, tiny_model_path: Path
) -> None:
    expected = _expected(two_workers.base_url, 600)
    killed_at: list[float] = []
    cut_short: list[bool] = []  # a dead worker ends nothing: the job still ran at the kill

    def kill_and_restart(count: int, payload: str) -> None:
        if count == 4:
            victim = two_workers.worker_of(json.loads(payload)["id"])
            index = two_workers.workers.index(victim)
            victim.popen.send_signal(signal.SIGKILL)
            victim.popen.wait()
            killed_at.append(time.monotonic())
            cut_short.append(two_workers.job_state(json.loads(payload)["id"]) in ("running", "queued"))
            # Same --worker-id, at once: its registry entry still looks alive. Same dtype as the
            # fixture's workers (the default), so the continuation is the same text.
            settings = {
                "model": tiny_model_path, "served_model_name": MODEL, "max_model_len": 1024,
                "worker_id": f"{two_workers.key_prefix}-worker{index}", "heartbeat_interval_s": 0.5,
            }  # fmt: skip
            two_workers.workers[index] = two_workers._spawn("worker", f"worker{index}-again", settings)

    arrivals: list[float] = []
    data = _stream(
        two_workers.base_url,
        {**BODY, "max_tokens": 600, "stream": True},
        lambda n, p: (arrivals.append(time.monotonic()), kill_and_restart(n, p)),
    )
    assert cut_short == [True], "the job ended before the kill"
    assert data[-1] == "[DONE]" and _text(data) == expected
    after = [t for t in arrivals if t > killed_at[0]]
    assert after and after[0] - killed_at[0] < 10


def test_4_a_paused_worker_resumed_after_takeover_writes_nothing_more(two_workers: Stack) -> None:
    expected = _expected(two_workers.base_url, 800)
    paused: list[object] = []
    arrivals: list[float] = []

    def pause(count: int, payload: str) -> None:
        arrivals.append(time.monotonic())
        if count == 4:
            job_id = json.loads(payload)["id"]
            victim = two_workers.worker_of(job_id)
            victim.popen.send_signal(signal.SIGSTOP)
            paused.append((victim, job_id, time.monotonic()))

    data = _stream(two_workers.base_url, {**BODY, "max_tokens": 800, "stream": True}, pause)
    victim, job_id, paused_at = paused[0]  # type: ignore[misc]
    victim.popen.send_signal(signal.SIGCONT)  # type: ignore[attr-defined]
    # The other worker took the job over within its lease: how long the rest of the text then
    # takes is the engine's speed, not the takeover's.
    taken_over = [at for at in arrivals if at > paused_at]
    assert taken_over and taken_over[0] - paused_at < 15
    assert data[-1] == "[DONE]" and _text(data) == expected
    # The resumed worker runs on: its writes must be refused.
    refused = ("moved on without this worker", "handed_back")
    wait_until(lambda: any(text in victim.log() for text in refused), "the resumed worker was never refused")  # type: ignore[attr-defined]
    seqs = _log_seqs(two_workers, job_id)
    assert seqs == list(range(len(seqs)))  # no duplicate, no gap


def test_6_last_event_id_past_the_end_or_negative_answers_at_once(two_workers: Stack) -> None:
    body = {**BODY, "max_tokens": 5, "stream": True, "resumable": True}
    data = _stream(two_workers.base_url, body)
    job_id = json.loads(data[0])["id"]
    url = f"{two_workers.base_url}/v1/chat/completions/{job_id}/stream"
    last_seq = 7  # start, 5 deltas, end
    for header, status in (("-1", 400), ("abc", 400), (str(last_seq + 5), 400)):
        started = time.monotonic()
        reply = httpx.get(url, headers={"Last-Event-ID": header}, timeout=10)
        assert reply.status_code == status and time.monotonic() - started < 2, (header, reply.text)
        assert reply.json()["error"]["type"] == "invalid_request_error"
    started = time.monotonic()
    reply = httpx.get(url, headers={"Last-Event-ID": str(last_seq - 1)}, timeout=10)
    assert reply.status_code == 200 and time.monotonic() - started < 2
    assert reply.text.strip().endswith("data: [DONE]") and '"usage"' not in reply.text


def test_7_a_poisoned_batch_line_fails_its_batch_at_validation_and_others_go_on(tiny_stack: Stack) -> None:
    from tests.conftest import TINY_MODEL

    good = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    poisoned = {**good, "metadata": {"\ud800": "lone surrogate key"}}
    lines = [
        json.dumps({"custom_id": "good", "method": "POST", "url": "/v1/chat/completions", "body": good}),
        json.dumps({"custom_id": "poisoned", "method": "POST", "url": "/v1/chat/completions", "body": poisoned}),
    ]
    batches = []
    for content in ("\n".join(lines), lines[0].replace('"good"', '"other"')):
        files = {"file": ("b.jsonl", content.encode(), "application/jsonl")}
        uploaded = httpx.post(f"{tiny_stack.base_url}/v1/files", data={"purpose": "batch"}, files=files).json()
        created = httpx.post(
            f"{tiny_stack.base_url}/v1/batches",
            json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        ).json()
        batches.append(created["id"])
    deadline = time.monotonic() + 60
    states: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        states = [httpx.get(f"{tiny_stack.base_url}/v1/batches/{b}").json() for b in batches]
        if all(s["status"] in ("completed", "failed") for s in states):
            break
        time.sleep(0.2)
    assert [s["status"] for s in states] == ["failed", "completed"], states
    [problem] = states[0]["errors"]["data"]  # type: ignore[index]
    assert problem["line"] == 2 and problem["param"] == "body.metadata.\\ud800", problem


def test_10_a_job_past_its_timeout_ends_with_job_timeout(fresh_stack: Stack, tiny_model_path: Path) -> None:
    fresh_stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024, job_timeout_s=1)
    worker = fresh_stack.workers[0]

    def stall(count: int, _payload: str) -> None:
        if count == 2:  # the job's wall time passes its 1 s timeout while the worker is stopped
            worker.popen.send_signal(signal.SIGSTOP)
            time.sleep(1.5)
            worker.popen.send_signal(signal.SIGCONT)

    data = _stream(fresh_stack.base_url, {**BODY, "max_tokens": 900, "stream": True}, stall)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "job_timeout"


def test_api_paused_and_resumed_mid_stream_delivers_the_whole_text(two_workers: Stack) -> None:
    expected = _expected(two_workers.base_url, 300)
    assert two_workers.api is not None
    api = two_workers.api

    def pause(count: int, _payload: str) -> None:
        if count == 3:
            api.popen.send_signal(signal.SIGSTOP)
            time.sleep(3.0)
            api.popen.send_signal(signal.SIGCONT)

    data = _stream(two_workers.base_url, {**BODY, "max_tokens": 300, "stream": True}, pause)
    assert data[-1] == "[DONE]" and _text(data) == expected
