"""Keep-alive while a streaming request waits in the queue: the stream starts after one keep-alive
period and sends comments until its job runs, so proxies and clients do not cut it; a rejection
that comes after the stream started arrives as an error event and ``[DONE]``.

The worker's only slot is held by a blocker for as long as the test says, whatever the CPU: the
blocker's first token shows it holds the slot, then the worker is paused (its heartbeat outlives
the pause) until the waiting stream has heard enough keep-alives, and the blocker is dropped."""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_stack
from tests.support.stack import Stack

pytestmark = pytest.mark.slow
MODEL = "keep-alive-tiny"
PING_S = 0.2
HELD_FOR_PINGS = 3  # keep-alives the waiting stream must hear before the slot is let go


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


def _read_while_held(stack: Stack, body: dict[str, object]) -> tuple[list[tuple[float, str]], float]:
    """Lines of a stream sent while a blocker holds the worker's only slot, each with its arrival
    time after the request; and when the slot was let go. The slot is held until the waiting
    stream has heard ``HELD_FOR_PINGS`` keep-alives."""
    (worker,) = stack.workers
    url = f"{stack.base_url}/v1/chat/completions"
    blocker = httpx.stream("POST", url, json=_body(max_tokens=900, ignore_eos=True), timeout=60)
    with blocker as held:
        assert held.status_code == 200
        blocker_lines = held.iter_lines()
        while next(blocker_lines) != "id: 1":  # its first token: the blocker runs and holds the slot
            pass
        worker.popen.send_signal(signal.SIGSTOP)

        def release() -> None:
            worker.popen.send_signal(signal.SIGCONT)
            held.close()  # the client leaves: the blocker's job is cancelled and the slot freed

        try:
            return _read_waiting(url, body, release)
        finally:
            worker.popen.send_signal(signal.SIGCONT)


def _read_waiting(
    url: str, body: dict[str, object], release: Callable[[], None]
) -> tuple[list[tuple[float, str]], float]:
    started = time.monotonic()
    released_at = float("inf")
    lines: list[tuple[float, str]] = []
    with httpx.stream("POST", url, json=body, timeout=60) as waiting:
        assert waiting.status_code == 200
        for line in waiting.iter_lines():
            at = time.monotonic() - started
            lines.append((at, line))
            pings = sum(1 for _, seen in lines if seen.startswith(": keep-alive"))
            if released_at == float("inf") and pings >= HELD_FOR_PINGS:
                released_at = at
                release()
    return lines, released_at


def test_a_queued_stream_gets_keep_alives_until_its_job_runs(one_slot: Stack) -> None:
    lines, released_at = _read_while_held(one_slot, _body(max_tokens=4))
    comments = [at for at, line in lines if line.startswith(": keep-alive")]
    first_delta = next(at for at, line in lines if line == "id: 1")  # id 0 is the role chunk
    # Nothing of the job came while the slot was held, and the server spoke every keep-alive
    # period meanwhile: the first comment after about one period, no gap much longer.
    assert first_delta > released_at
    waited = [at for at in comments if at < first_delta]
    assert len(waited) >= HELD_FOR_PINGS
    assert waited[0] < 3 * PING_S
    assert max(later - earlier for earlier, later in itertools.pairwise(waited)) < 5 * PING_S  # slack for a busy host
    assert [line for _, line in lines if line][-1] == "data: [DONE]"


def test_a_rejection_after_the_stream_started_is_an_error_event(one_slot: Stack) -> None:
    # Only the worker, which tokenizes it, can tell that this prompt is past the context.
    too_long = _body(messages=[{"role": "user", "content": "go " * 1200}])
    lines, released_at = _read_while_held(one_slot, too_long)
    data = [(at, line[6:]) for at, line in lines if line.startswith("data: ")]
    assert data[-1][1] == "[DONE]"
    assert json.loads(data[-2][1])["error"]["code"] == "context_length_exceeded"
    # The stream had started (its keep-alives) before the worker could look at the prompt.
    assert any(line.startswith(": keep-alive") for at, line in lines if at < released_at)
    assert data[-2][0] > released_at
