"""Speculation cannot change the text: the same requests through the official SDK to a worker
with ``--speculative ngram`` (the default) and one with ``off`` get the same answers, byte for
byte: text, tool-call arguments, logprobs, finish reasons and usage, for greedy and seeded
sampling, a JSON schema, a forced tool call, ``n: 2``, stop strings, and a mixed batch sent at
once. The speculating worker's ``/metrics`` show it drafted and kept drafts. A tiny random
Qwen3 (real tokenizer and chat template, exact numerics): its answers repeat themselves, which
is what n-gram drafts feed on."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_stack
from tests.support.qwen import tiny_random_qwen3_dir
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

MODEL = "qwen-random"
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_products",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "enum": ["shoes", "boots", "socks"]},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            },
            "required": ["query", "limit"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}, "year": {"type": "integer"}},
    "required": ["city", "year"],
    "additionalProperties": False,
}
STORY = "Tell me a story about a lighthouse keeper and the ships that pass."
REQUESTS: dict[str, dict[str, Any]] = {
    "greedy": {"messages": [{"role": "user", "content": STORY}], "temperature": 0, "max_tokens": 48},
    "seeded": {
        "messages": [{"role": "user", "content": STORY}], "temperature": 0.9, "top_p": 0.9, "seed": 3,
        "max_tokens": 48,
    },
    "json_schema": {
        "messages": [{"role": "user", "content": "A city and a year, as JSON."}], "temperature": 0, "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "when", "schema": SCHEMA, "strict": True}},
    },
    "forced_tool": {
        "messages": [{"role": "user", "content": "find shoes"}], "tools": [SEARCH], "seed": 4, "max_tokens": 120,
        "tool_choice": {"type": "function", "function": {"name": "search_products"}},
    },
    "n_2": {
        "messages": [{"role": "user", "content": STORY}], "n": 2, "temperature": 1.0, "seed": 8, "max_tokens": 32,
    },
    "logprobs": {
        "messages": [{"role": "user", "content": STORY}], "temperature": 0, "max_tokens": 32, "logprobs": True,
        "top_logprobs": 3,
    },
}  # fmt: skip


def _stack(redis_url: str, log_dir: Path, speculative: str) -> Stack:
    stack = make_stack(redis_url, log_dir)
    stack.start_api()
    stack.start_worker(
        tiny_random_qwen3_dir("qwen3"), MODEL, dtype="float32", max_model_len=1024, speculative=speculative
    )
    return stack


@pytest.fixture(scope="module")
def stacks(redis_url: str, log_dir: Path) -> Iterator[dict[str, Stack]]:
    started: dict[str, Stack] = {}
    try:
        for setting in ("ngram", "off"):
            started[setting] = _stack(redis_url, log_dir, setting)
        yield started
    finally:
        for stack in started.values():
            stack.stop()


def _answer(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    """What the client reads, less what differs between any two calls (ids, times)."""
    reply = stack.client().chat.completions.create(model=MODEL, **body).model_dump()
    for key in ("id", "created", "system_fingerprint"):
        reply.pop(key, None)
    for choice in reply["choices"]:
        for call in choice["message"].get("tool_calls") or []:
            call.pop("id", None)
    return reply


@pytest.mark.parametrize("kind", list(REQUESTS))
def test_the_answer_is_the_same_with_and_without_speculation(stacks: dict[str, Stack], kind: str) -> None:
    body = REQUESTS[kind]
    assert _answer(stacks["ngram"], body) == _answer(stacks["off"], body)


def test_stop_strings_and_a_mixed_batch_at_once_are_the_same(stacks: dict[str, Stack]) -> None:
    greedy = _answer(stacks["off"], REQUESTS["greedy"])["choices"][0]["message"]["content"]
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 4]  # reached half-way through the answer
    bodies = [*REQUESTS.values(), {**REQUESTS["greedy"], "stop": [stop]}]
    answers: dict[str, list[dict[str, Any]]] = {}
    for setting, stack in stacks.items():
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers[setting] = list(pool.map(lambda body, stack=stack: _answer(stack, body), bodies))
    assert answers["ngram"] == answers["off"]
    stopped = answers["ngram"][-1]["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["message"]["content"]) < len(greedy)


def test_the_speculating_worker_drafts_and_keeps_drafts_and_the_other_does_not(stacks: dict[str, Stack]) -> None:
    _answer(stacks["ngram"], REQUESTS["greedy"])
    drafted = stacks["ngram"].metric("relaylm:spec_decode_num_draft_tokens_total")
    accepted = stacks["ngram"].metric("relaylm:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert 0 < stacks["ngram"].metric("relaylm:spec_decode_draft_acceptance_rate") <= 1
    assert stacks["off"].metric("relaylm:spec_decode_num_draft_tokens_total") == 0
