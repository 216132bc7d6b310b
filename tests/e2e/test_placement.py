"""Placement by prefix with real processes: a conversation's next turn is claimed by the worker
that ran its last one (and is served from that worker's prefix cache), a preferred worker that
died delays nothing past the placement window, with the same text from the other worker, and a
worker whose cache did not keep a conversation does not say it holds it."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.conftest import TWO_WORKER_MODEL
from tests.support.stack import Stack

pytestmark = pytest.mark.slow
WINDOW_S = 2.0  # the API's default --placement-window-s


def _chat(stack: Stack, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": TWO_WORKER_MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _turn_one(stack: Stack, session: int, on: int) -> tuple[list[dict[str, Any]], str]:
    """A session's first turn, run on worker ``on`` (the other is held meanwhile); the
    conversation so far, with the answer, and the worker that holds it."""
    messages = [
        {"role": "system", "content": f"You are agent number {session}. " + "Follow the rules. " * 40},
        {"role": "user", "content": f"Start task {session}."},
    ]
    with stack.workers[1 - on].paused():
        answer = _chat(stack, messages)
    owner = stack.job_owner(answer["id"])
    assert owner == f"{stack.key_prefix}-worker{on}"
    return [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}], owner


def _held(stack: Stack, worker: int) -> set[str]:
    worker_id = f"{stack.key_prefix}-worker{worker}"
    info = stack.worker_info(worker_id)
    assert info is not None
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return {key.decode() for key in client.zrange(stack.keys.worker_held_keys(worker_id, info.instance), 0, -1)}
    finally:
        client.close()


def _matched(stack: Stack) -> float:
    metrics = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    found = re.search(r'relaylm:placements_total\{model="[^"]+",outcome="matched"\} ([0-9.]+)', metrics)
    return float(found.group(1)) if found else 0.0


def test_each_conversations_next_turn_is_claimed_by_the_worker_that_holds_it(two_workers: Stack) -> None:
    sessions = [_turn_one(two_workers, session, on=session % 2) for session in range(4)]
    for turn in range(2):
        for index, (messages, owner) in enumerate(sessions):
            follow_up = [*messages, {"role": "user", "content": f"Go on with step {turn}."}]
            answer = _chat(two_workers, follow_up)
            assert two_workers.job_owner(answer["id"]) == owner, f"session {index}, turn {turn + 2}"
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            content = answer["choices"][0]["message"]["content"]
            sessions[index] = ([*follow_up, {"role": "assistant", "content": content}], owner)
    assert _matched(two_workers) >= 8


def test_a_completion_that_extends_an_earlier_prompt_is_claimed_by_the_worker_that_ran_it(two_workers: Stack) -> None:
    """A completion prompt that grows (a pipeline's document, a client's own turn format) goes to
    the worker whose prefix cache holds its earlier form."""
    for on in (0, 1):
        prompt = f"Document {on}. " + "Every line of the record is kept. " * 90  # past three key blocks
        body = {"model": TWO_WORKER_MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with two_workers.workers[1 - on].paused():
            first = _post(two_workers, "/v1/completions", {**body, "prompt": prompt})
        owner = two_workers.job_owner(first["id"])
        assert owner == f"{two_workers.key_prefix}-worker{on}"
        for step in range(2):
            prompt += first["choices"][0]["text"] + f" Step {step} adds a line."
            later = _post(two_workers, "/v1/completions", {**body, "prompt": prompt})
            assert two_workers.job_owner(later["id"]) == owner, f"document {on}, step {step}"
            assert later["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_dead_preferred_worker_delays_its_conversation_by_the_window_at_most(two_workers: Stack) -> None:
    messages, owner = _turn_one(two_workers, 7, on=0)
    follow_up = [*messages, {"role": "user", "content": "And then?"}]
    expected = _chat(two_workers, follow_up)  # on its holder, worker 0
    assert two_workers.job_owner(expected["id"]) == owner
    victim = two_workers.workers[0]
    victim.popen.send_signal(signal.SIGKILL)
    victim.popen.wait()
    started = time.monotonic()
    answer = _chat(two_workers, follow_up)  # its heartbeat record outlives it for a few seconds
    assert time.monotonic() - started < WINDOW_S + 5.0
    assert two_workers.job_owner(answer["id"]) == f"{two_workers.key_prefix}-worker1"
    assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]


def test_a_worker_holds_a_conversation_only_while_its_prefix_cache_does(
    two_workers: Stack, tiny_model_path: Path
) -> None:
    """Worker 2 caches no prefixes (``--prefix-cache-memory-gib 0``): once its turn ends it holds
    none of the conversation's keys, and the next turn is not placed on it."""
    stack = two_workers
    stack.start_worker(tiny_model_path, TWO_WORKER_MODEL, max_model_len=1024, prefix_cache_memory_gib=0)
    messages = [
        {"role": "system", "content": "You are the uncached agent. " + "Follow the rules. " * 40},
        {"role": "user", "content": "Start."},
    ]
    with stack.workers[0].paused(), stack.workers[1].paused():
        answer = _chat(stack, messages)
    assert stack.job_owner(answer["id"]) == f"{stack.key_prefix}-worker2"
    deadline = time.monotonic() + 10
    while _held(stack, 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _held(stack, 2) == set()
    assert _held(stack, 0) == set() and _held(stack, 1) == set()
    follow_up = [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}]
    before = _matched(stack)
    _chat(stack, [*follow_up, {"role": "user", "content": "Go on."}])
    assert _matched(stack) == before


def _post(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_a_named_conversation_finds_its_worker_from_its_second_turn_on(two_workers: Stack) -> None:
    """One-message turns share no prefix with each other; ``prompt_cache_key`` and a Responses
    chain (``previous_response_id``) say which turns belong together."""
    stack = two_workers
    worker = [f"{stack.key_prefix}-worker{index}" for index in range(2)]
    sampling = {"model": TWO_WORKER_MODEL, "temperature": 0}
    keyed, chained = [], []
    for session in range(4):
        on = session % 2
        with stack.workers[1 - on].paused():
            chat = {**sampling, "max_tokens": 4, "prompt_cache_key": f"agent-{session}"}
            answer = _post(stack, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "Hi"}]})
            assert stack.job_owner(answer["id"]) == worker[on]
            keyed.append(chat)
            response = _post(stack, "/v1/responses", {**sampling, "max_output_tokens": 4, "input": f"Task {session}"})
            assert stack.job_owner(response["id"].removeprefix("resp_")) == worker[on]
            chained.append(response["id"])
    for session in range(4):
        on = session % 2
        message = [{"role": "user", "content": f"Something else, {session}"}]
        answer = _post(stack, "/v1/chat/completions", {**keyed[session], "messages": message})
        assert stack.job_owner(answer["id"]) == worker[on], f"prompt_cache_key, session {session}"
        body = {**sampling, "max_output_tokens": 4, "input": "Go on.", "previous_response_id": chained[session]}
        response = _post(stack, "/v1/responses", body)
        assert stack.job_owner(response["id"].removeprefix("resp_")) == worker[on], f"responses, session {session}"
