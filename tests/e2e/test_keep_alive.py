"""Keep-alive while a streaming request waits in the queue: the stream starts after one keep-alive
period and sends comments until its job runs, so proxies and clients do not cut it; a rejection
that comes after the stream started arrives as an error event and ``[DONE]``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_stack
from tests.support.stack import Stack

pytestmark = pytest.mark.slow
MODEL = "keep-alive-tiny"
PING_S = 0.2  # well under the blocker's run (~1 s of 900 tokens on the tiny model, or more)


@pytest.fixture(scope="module")
def one_slot(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    """One worker that runs one sequence at a time, so a second request waits in the queue."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(sse_ping_interval_s=PING_S)
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024, max_num_seqs=1)
        yield stack
    finally:
        stack.stop()


def _body(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True, **fields}


def _read_while_busy(stack: Stack, body: dict[str, object]) -> tuple[list[tuple[float, str]], float]:
    """Lines of a stream sent while another stream holds the worker's only slot, each with its
    arrival time after the request; and how long the blocker ran."""
    url = f"{stack.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=_body(max_tokens=900, ignore_eos=True), timeout=60) as blocker:
        assert blocker.status_code == 200
        started = time.monotonic()
        lines: list[tuple[float, str]] = []
        with httpx.stream("POST", url, json=body, timeout=60) as waiting:
            assert waiting.status_code == 200
            for line in waiting.iter_lines():
                lines.append((time.monotonic() - started, line))
        blocker.read()
    return lines, time.monotonic() - started


def test_a_queued_stream_gets_keep_alives_until_its_job_runs(one_slot: Stack) -> None:
    lines, _ = _read_while_busy(one_slot, _body(max_tokens=4))
    comments = [at for at, line in lines if line.startswith(": keep-alive")]
    first_delta = next(at for at, line in lines if line == "id: 1")  # id 0 is the role chunk
    # The 900-token blocker takes seconds on the tiny model: the waiting stream hears from the
    # server at least once a keep-alive period meanwhile.
    assert comments and comments[0] < 3 * PING_S
    assert len([at for at in comments if at < first_delta]) >= 2
    assert [line for _, line in lines if line][-1] == "data: [DONE]"


def test_a_rejection_after_the_stream_started_is_an_error_event(one_slot: Stack) -> None:
    # Only the worker, which tokenizes it, can tell that this prompt is past the context.
    too_long = _body(messages=[{"role": "user", "content": "go " * 1200}])
    lines, _ = _read_while_busy(one_slot, too_long)
    data = [line[6:] for _, line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "context_length_exceeded"
