"""Fixtures shared by the end-to-end fault tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_stack
from tests.support.stack import Stack

TWO_WORKER_MODEL = "two-worker-tiny"


@pytest.fixture
def two_workers(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    """API + two workers on the tiny random model in the default dtype (bf16 on the CPU), serving
    ``TWO_WORKER_MODEL``."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        for _ in range(2):
            stack.start_worker(tiny_model_path, TWO_WORKER_MODEL, max_model_len=1024)
        yield stack
    finally:
        stack.stop()
