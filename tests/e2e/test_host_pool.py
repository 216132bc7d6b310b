"""Two workers started with the defaults on one host pool their shared cores (real Redis, API and
worker processes): the older takes every job it has room for and runs with the cores to itself;
the younger takes what the older leaves, and both then share the cores."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_stack
from tests.support.stack import Process, Stack, wait_until
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
        younger = stack.workers[1]
        wait_until(lambda: "(rank 1 on its cores)" in younger.log(), "the younger never saw the older worker")
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
    # the younger takes them; every one finishes. However fast the engine, the older cannot free
    # a slot before the younger has taken the rest (it is held once its slots are full), nor the
    # younger be done before the older has read that it is busy (it is held then, until the older
    # has changed its thread count).
    cores = available_cores()
    younger_id = f"{pooled.key_prefix}-worker1"
    with ThreadPoolExecutor(2 * SLOTS) as pool:
        chats = [pool.submit(_chat, pooled, 900) for _ in range(2 * SLOTS)]
        wait_until(lambda: _picked(older) >= 2 * SLOTS, "the older worker never filled its slots")
        with contextlib.ExitStack() as held:
            with older.paused():
                wait_until(lambda: _picked(younger) >= SLOTS, "the younger never took what the older left")
                wait_until(lambda: _num_jobs(pooled, younger_id) > 0, "the younger never said it was busy")
                held.enter_context(younger.paused())
            if cores >= 2:
                wait_until(lambda: cores // 2 in _thread_counts(older), "the older never made room for the younger")
        texts = [chat.result() for chat in chats]
    assert len(texts) == 2 * SLOTS and all(texts)
    assert (_picked(older), _picked(younger)) == (2 * SLOTS, SLOTS)
    if cores >= 2:
        # Alone with work, the older ran on every core; while the younger was busy, on half.
        assert _thread_counts(older)[:1] == [cores] and cores // 2 in _thread_counts(older)


def _num_jobs(stack: Stack, worker_id: str) -> int:
    info = stack.worker_info(worker_id)
    return info.num_jobs if info is not None else 0


def test_when_the_older_worker_is_gone_the_younger_takes_jobs_at_once(pooled: Stack) -> None:
    older, younger = pooled.workers
    older.stop()  # SIGTERM: it drains and leaves the registry
    rank_0 = "claims jobs queued for 0.00 s or more (rank 0"
    wait_until(lambda: rank_0 in younger.log(), "the younger never took the older one's place")
    assert _chat(pooled, 20)
    assert _picked(younger) == 1
