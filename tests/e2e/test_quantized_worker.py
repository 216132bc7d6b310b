"""A worker started with ``--quantization int8`` serves, and says in its log how it holds the
weights: 8-bit groups on the exact kernels (``--deterministic on``, the default), or packed int8
copies for small decode batches (``--deterministic off``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL, make_stack


@pytest.mark.parametrize(
    ("deterministic", "logged"),
    [
        ("on", "0 matmuls on the GGUF's 4-bit groups, 0 quantized to 4 bits, 9 8-bit"),
        ("off", "weights quantized: int8"),
    ],
)
def test_an_int8_worker_serves_chat(
    redis_url: str, log_dir: Path, tiny_model_path: Path, deterministic: str, logged: str
) -> None:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        settings = {"dtype": "float32", "max_model_len": 256, "quantization": "int8", "deterministic": deterministic}
        worker = stack.start_worker(tiny_model_path, TINY_MODEL, **settings)
        messages = [{"role": "user", "content": "hi"}]
        reply = stack.client().chat.completions.create(
            model=TINY_MODEL,
            messages=messages,
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        assert logged in worker.log()
    finally:
        stack.stop()
