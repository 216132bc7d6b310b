"""The fair share with real processes: one key's flood does not hold back another key's request
across two workers, a key's own requests go by their priority, and /metrics shows who holds the
engine without naming a key."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import make_stack
from tests.support.stack import Stack, wait_until

pytestmark = pytest.mark.slow
MODEL = "fair-tiny"
KEYS = {"flood": "sk-flood-key-0001", "quiet": "sk-quiet-key-0002"}


@pytest.fixture(scope="module")
def stack(
    redis_url: str, log_dir: Path, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """API with two keys, two workers of one slot each: every job waits its turn in the claim."""
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("".join(f"{key}\n" for key in KEYS.values()))
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(api_key_file=key_file, metrics_public="true")
        for _ in range(2):
            stack.start_worker(tiny_model_path, MODEL, max_model_len=1024, max_num_seqs=1, speculative="off")
        yield stack
    finally:
        stack.stop()


class _Requests:
    """Chat requests sent from threads; ``finished`` lists their names in the order they ended."""

    def __init__(self, stack: Stack) -> None:
        self._stack = stack
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.finished: list[str] = []

    def send(self, name: str, key: str, priority: int = 0) -> None:
        body: dict[str, Any] = {
            "model": MODEL, "messages": [{"role": "user", "content": f"Request {name}."}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "priority": priority,
        }  # fmt: skip
        headers = {"Authorization": f"Bearer {key}"}

        def run() -> None:
            response = httpx.post(
                f"{self._stack.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120
            )
            assert response.status_code == 200, response.text
            with self._lock:
                self.finished.append(name)

        thread = threading.Thread(target=run)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=120)


def _queued(stack: Stack) -> int:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return int(client.zcard(stack.keys.queue(MODEL)))
    finally:
        client.close()


def _queue_while_paused(stack: Stack, workers: list[int], send: list[tuple[str, str, int]]) -> _Requests:
    """Send every request while the workers are paused, so that all are queued before any claim."""
    requests = _Requests(stack)
    paused = [stack.workers[index] for index in workers]
    for process in paused:
        process.popen.send_signal(signal.SIGSTOP)
    try:
        for name, key, priority in send:
            requests.send(name, key, priority)
            time.sleep(0.02)  # each one queued after the one before: its enqueue time orders them
        wait_until(lambda: _queued(stack) == len(send), "every request queued", timeout_s=30)
    finally:
        for process in paused:
            process.popen.send_signal(signal.SIGCONT)
    return requests


def test_one_keys_flood_does_not_hold_back_another_keys_request_on_two_workers(stack: Stack) -> None:
    flood = [(f"flood-{i}", KEYS["flood"], 0) for i in range(12)]
    requests = _queue_while_paused(stack, [0, 1], [*flood, ("quiet", KEYS["quiet"], 0)])
    requests.join()
    assert len(requests.finished) == 13
    # First come, first served would run it 13th; the fair share takes it second (it joins level
    # with the flood's key, whose older job wins the tie).
    assert requests.finished.index("quiet") <= 3, requests.finished


def test_a_keys_own_requests_go_by_priority_then_age(stack: Stack) -> None:
    send = [("late", KEYS["quiet"], 5), ("first", KEYS["quiet"], -5), ("normal", KEYS["quiet"], 0)]
    send += [("first-too", KEYS["quiet"], -5)]
    with stack.workers[1].paused():
        requests = _queue_while_paused(stack, [0], send)
        requests.join()
    assert requests.finished == ["first", "first-too", "normal", "late"]


def test_a_priority_out_of_range_is_a_400_naming_the_field(stack: Stack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": 5000}
    headers = {"Authorization": f"Bearer {KEYS['quiet']}"}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"


def test_metrics_show_each_keys_service_by_its_keyed_hash_never_the_key(stack: Stack) -> None:
    requests = _Requests(stack)
    for name, key in KEYS.items():
        requests.send(name, key)
    requests.join()
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    served = re.findall(r'^relaylm:tenant_served_tokens_total\{[^}]*tenant="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    assert len(served) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", tenant) for tenant, _ in served)
    assert all(float(tokens) > 0 for _, tokens in served)
    assert not any(key in text for key in KEYS.values())
