"""Every README and docs example marked ``<!-- runnable -->`` runs, unchanged but for its address,
against a real stack: the API, a worker serving the tiny random model under the default chat
model's name (the text is gibberish; the calls, shapes and exit status are what is checked) and
a worker on the real packaged embedding model."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_stack
from tests.support.docs import CodeBlock, runnable_blocks
from tests.support.stack import Stack
from worker.embedding.loader import DEFAULT_EMBEDDING_MODEL

CHAT_MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
_DOCUMENTED_ADDRESSES = ("http://127.0.0.1:8000", "http://localhost:8000")
_EXAMPLE_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def docs_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        stack.start_worker(tiny_model_path, CHAT_MODEL, dtype="float32", max_model_len=1024)
        stack.start_worker(DEFAULT_EMBEDDING_MODEL, EMBEDDING_MODEL)
        yield stack
    finally:
        stack.stop()


def test_the_docs_mark_examples_runnable() -> None:
    blocks = runnable_blocks()
    assert {block.language for block in blocks} >= {"python", "bash"}
    assert any(block.path.name == "README.md" for block in blocks)


@pytest.mark.slow
@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda block: block.name)
def test_runnable_example(block: CodeBlock, docs_stack: Stack, tmp_path: Path) -> None:
    code = block.code
    for address in _DOCUMENTED_ADDRESSES:
        code = code.replace(address, docs_stack.base_url)
    env = {**os.environ, "OPENAI_BASE_URL": f"{docs_stack.base_url}/v1", "OPENAI_API_KEY": "unused"}
    if block.language == "python":
        command = [sys.executable, "-c", code]
    elif block.language in ("bash", "sh", "shell"):
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        pytest.fail(f"{block.name}: a runnable example must be python or bash, not {block.language!r}")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=_EXAMPLE_TIMEOUT_S)
    assert result.returncode == 0, f"{block.name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
