"""A worker started with ``--quantization int8`` serves, and says so in its log."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TINY_MODEL, make_stack


def test_an_int8_worker_serves_chat(redis_url: str, log_dir: Path, tiny_model_path: Path) -> None:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        settings = {"dtype": "float32", "max_model_len": 256, "quantization": "int8"}
        worker = stack.start_worker(tiny_model_path, TINY_MODEL, **settings)
        messages = [{"role": "user", "content": "hi"}]
        reply = stack.client().chat.completions.create(
            model=TINY_MODEL,
            messages=messages,
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        assert "weights quantized: int8" in worker.log()
    finally:
        stack.stop()
