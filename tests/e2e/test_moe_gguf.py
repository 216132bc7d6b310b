"""A Qwen3-MoE GGUF served as it is by three workers (``relaylm worker --model file.gguf``): the
file's tokenizer, chat template and parsers, and a stream whose worker is SIGKILLed continues on
another with the text it would have had (greedy and seeded)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_stack
from tests.e2e.test_fault_tolerance import _text, stream_killing_its_worker
from tests.support.qwen import tiny_qwen3_moe_gguf
from tests.support.stack import Stack
from worker.native import exact

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not exact.available(), reason="GGUF files are served on the exact kernels"),
]
MODEL = "qwen-moe-gguf"


@pytest.fixture(scope="module")
def moe_workers(redis_url: str, log_dir: Path) -> Iterator[Stack]:
    path = tiny_qwen3_moe_gguf()
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        # Three: each of the two failover tests kills one. One after the other: the first converts
        # the file's tokenizer into the cache.
        for _ in range(3):
            stack.start_worker(path, MODEL, max_model_len=1024)
        yield stack
    finally:
        stack.stop()


def test_the_file_is_served_with_its_template_and_qwen3_parsers(moe_workers: Stack) -> None:
    models = httpx.get(f"{moe_workers.base_url}/v1/models", timeout=10).json()["data"]
    assert any(model["id"] == MODEL and model["num_live_workers"] == 3 for model in models)
    log = moe_workers.workers[0].log()
    assert "native forward from the GGUF: qwen3_moe, 2 layers, 16 experts, 4 a token" in log
    assert "tool parser: hermes, reasoning parser: qwen3" in log
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = httpx.post(f"{moe_workers.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    # The file's own chat template rendered the prompt (Qwen3's, with its thinking block).
    assert response.json()["usage"]["prompt_tokens"] > 5


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_a_killed_workers_moe_stream_continues_with_the_same_text(
    moe_workers: Stack, sampling: dict[str, object]
) -> None:
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "tell me everything"}], "ignore_eos": True,
        "max_tokens": 300, **sampling,
    }  # fmt: skip
    undisturbed = httpx.post(f"{moe_workers.base_url}/v1/chat/completions", json=body, timeout=120)
    expected = undisturbed.json()["choices"][0]["message"]["content"]
    data = stream_killing_its_worker(moe_workers, body)
    assert data[-1] == "[DONE]"
    assert _text(data) == expected
