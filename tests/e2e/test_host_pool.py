"""Two workers started with the defaults on one host pool their shared cores (real Redis, API and
worker processes): the older takes every job it has room for and runs with the cores to itself;
the younger takes what the older leaves, and both then share the cores."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_stack
from tests.support.stack import Process, Stack
from worker.service.host_pool import REFRESH_INTERVAL_S
from worker.service.thread_budget import available_cores

pytestmark = pytest.mark.slow
MODEL = "pooled-tiny"
SLOTS = 2


@pytest.fixture
def pooled(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    """API + two workers, started as a user would (no --num-threads), with ``SLOTS`` slots each."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        for _ in range(2):
            stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024, max_num_seqs=SLOTS)
        time.sleep(3 * REFRESH_INTERVAL_S)  # each has read the other's record
        yield stack
    finally:
        stack.stop()


def _chat(stack: Stack, max_tokens: int) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return str(choice["message"]["content"])


def _picked(worker: Process) -> int:
    return worker.log().count("event=picked")


def _thread_counts(worker: Process) -> list[int]:
    return [int(n) for n in re.findall(r"torch threads: (\d+)", worker.log())]


def test_the_older_worker_takes_what_it_has_room_for_and_the_younger_the_rest(pooled: Stack) -> None:
    older, younger = pooled.workers
    assert "claims jobs queued for 0.25 s or more (rank 1" in younger.log()
    with ThreadPoolExecutor(SLOTS) as pool:
        list(pool.map(lambda _i: _chat(pooled, 40), range(SLOTS)))
    assert (_picked(older), _picked(younger)) == (SLOTS, 0)

    # Twice as many long jobs as the older worker has slots: the rest wait a quarter second, then
    # the younger takes them; every one finishes.
    with ThreadPoolExecutor(2 * SLOTS) as pool:
        texts = list(pool.map(lambda _i: _chat(pooled, 600), range(2 * SLOTS)))
    assert len(texts) == 2 * SLOTS and all(texts)
    assert (_picked(older), _picked(younger)) == (2 * SLOTS, SLOTS)
    if available_cores() >= 2:
        cores = available_cores()
        # Alone with work, the older ran on every core; while the younger was busy, on half.
        assert _thread_counts(older)[:1] == [cores] and cores // 2 in _thread_counts(older)


def test_when_the_older_worker_is_gone_the_younger_takes_jobs_at_once(pooled: Stack) -> None:
    older, younger = pooled.workers
    older.stop()  # SIGTERM: it drains and leaves the registry
    deadline = time.monotonic() + 10
    while "claims jobs queued for 0.00 s or more (rank 0" not in younger.log():
        assert time.monotonic() < deadline, younger.log()
        time.sleep(0.1)
    assert _chat(pooled, 20)
    assert _picked(younger) == 1
