"""Placement by prefix with real processes: a conversation's next turn is claimed by the worker
that ran its last one (and is served from that worker's prefix cache), and a preferred worker
that died delays nothing past the placement window, with the same text from the other worker."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

import httpx
import pytest

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
