"""The Batch API and background chat jobs through the official ``openai`` client, against real
API and worker processes: a 200-line batch, invalid lines, cancelling, an API restart and a
worker SIGKILL mid-batch (every line exactly once), and a background job polled to the end."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types import Batch

from tests.conftest import make_stack
from tests.support.stack import Process, Stack

pytestmark = pytest.mark.slow
MODEL = "batch-tiny"
API_SETTINGS = {"batch_poll_interval_s": 0.2, "batch_concurrency": 16, "max_file_bytes": 1_000_000}


def _line(custom_id: str, content: str = "hi", max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **body,
        },
    }


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _submit(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Batch:
    uploaded = client.files.create(file=("input.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def _wait(client: openai.OpenAI, batch_id: str, until: Callable[[Batch], bool], timeout_s: float = 180) -> Batch:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
        except openai.APIConnectionError:  # an API process restarting
            time.sleep(0.2)
            continue
        if until(batch):
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} never got there: {client.batches.retrieve(batch_id)}")


def _done(batch: Batch) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def _output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def batch_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(**API_SETTINGS)
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=256, max_num_seqs=32)
        yield stack
    finally:
        stack.stop()


def test_a_200_line_batch_completes_with_one_output_line_each(batch_stack: Stack) -> None:
    client = batch_stack.client()
    lines = [_line(f"req-{i}", content=f"question {i}") for i in range(200)]
    created = _submit(client, lines)
    assert created.status == "validating" and created.request_counts.total == 0

    batch = _wait(client, created.id, _done)

    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 200, "completed": 200, "failed": 0}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.error_file_id is None
    outputs = _output_lines(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in outputs) == sorted(f"req-{i}" for i in range(200))
    for line in outputs:
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
        assert line["id"].startswith("batch_req_") and line["error"] is None
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_invalid_lines_are_reported_by_line_number_and_nothing_runs(batch_stack: Stack) -> None:
    client = batch_stack.client()
    wrong_url = {**_line("c"), "url": "/v1/embeddings"}
    raw = (
        _jsonl([_line("a")])
        + b"{not json\n"
        + _jsonl([_line("a"), wrong_url, _line("d", stream=True), _line("e", model="no-such-model")])
        + _jsonl([_line("f", messages=[])])
    )
    uploaded = client.files.create(file=("bad.jsonl", raw), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")

    batch = _wait(client, created.id, _done)

    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None
    reported = {(error.line, error.code) for error in batch.errors.data}
    assert reported == {
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_url"),
        (5, "stream_unsupported"),
        (6, "model_not_found"),
        (7, "invalid_request"),
    }
    assert batch.output_file_id is None


def test_bad_batch_and_file_requests_get_openai_errors(batch_stack: Stack) -> None:
    client = batch_stack.client()
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.batches.create(input_file_id="file-x", endpoint="/v1/moderations", completion_window="24h")  # type: ignore[arg-type]
    assert unsupported.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    response = httpx.post(
        f"{batch_stack.base_url}/v1/files", files={"file": ("big.jsonl", b"x" * 1_200_000)}, data={"purpose": "batch"}
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"
    # A multipart upload is checked like a JSON body: bytes that are not UTF-8 are a 400 naming the line.
    not_text = httpx.post(
        f"{batch_stack.base_url}/v1/files", files={"file": ("x.jsonl", b"{}\n\xff\xfe\n")}, data={"purpose": "batch"}
    )
    assert not_text.status_code == 400 and not_text.json()["error"]["param"] == "file"
    assert "line 2" in not_text.json()["error"]["message"]
    odd_name = httpx.post(  # a filename that is not UTF-8 is kept as its bytes decode, never a 500
        f"{batch_stack.base_url}/v1/files", files={"file": (b"\xff.jsonl".decode("latin-1"), b"{}\n")},
        data={"purpose": "batch"},
    )  # fmt: skip
    assert odd_name.status_code == 200
    uploaded = client.files.create(file=("gone.jsonl", _jsonl([_line("a")])), purpose="batch")
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(uploaded.id)


def test_cancel_mid_run_keeps_what_finished(batch_stack: Stack) -> None:
    client = batch_stack.client()
    created = _submit(client, [_line(f"c-{i}", max_tokens=48) for i in range(120)])
    _wait(client, created.id, lambda b: b.request_counts.completed >= 10)

    cancelling = client.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = _wait(client, created.id, _done)

    assert batch.status == "cancelled" and batch.cancelled_at
    assert 10 <= batch.request_counts.completed < 120
    outputs = _output_lines(client, batch.output_file_id)
    assert len(outputs) == batch.request_counts.completed
    assert len({line["custom_id"] for line in outputs}) == len(outputs)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(_wait(client, _submit(client, [_line("z")]).id, lambda b: b.status == "completed").id)


def test_an_api_restart_mid_batch_loses_nothing(batch_stack: Stack) -> None:
    client = batch_stack.client()
    created = _submit(client, [_line(f"r-{i}", max_tokens=24) for i in range(80)])
    _wait(client, created.id, lambda b: b.request_counts.completed >= 5)

    assert batch_stack.api is not None
    batch_stack.api.stop(signal.SIGKILL)
    # Only an API process finishes a batch, and 16 lines a 0.2 s advance make this one take five
    # advances or more: it was still running, however fast the engine.
    assert _stored(batch_stack, created.id)["status"] == "in_progress"
    batch_stack.start_api(**API_SETTINGS)
    batch = _wait(client, created.id, _done)

    assert batch.status == "completed" and batch.request_counts.completed == 80
    outputs = _output_lines(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in outputs) == sorted(f"r-{i}" for i in range(80))


def test_a_worker_killed_mid_batch_has_its_lines_run_again_exactly_once(
    redis_url: str, log_dir: Path, tiny_model_path: Path
) -> None:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(**API_SETTINGS)
        for _ in range(2):
            stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=512, max_num_seqs=8)
        client = stack.client()
        created = _submit(client, [_line(f"w-{i}", max_tokens=160) for i in range(48)])
        _wait(client, created.id, lambda b: b.request_counts.completed >= 4)

        _kill_while_it_runs_a_line(stack, stack.workers[0])
        batch = _wait(client, created.id, _done)

        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": 48, "completed": 48, "failed": 0}
        outputs = _output_lines(client, batch.output_file_id)
        assert sorted(line["custom_id"] for line in outputs) == sorted(f"w-{i}" for i in range(48))
        assert all(line["response"]["body"]["usage"]["completion_tokens"] == 160 for line in outputs)
        assert "event=requeued" in stack.api.log()  # type: ignore[union-attr]
    finally:
        stack.stop()


def _kill_while_it_runs_a_line(stack: Stack, victim: Process) -> None:
    """SIGKILL ``victim`` at a moment it holds a running line, however fast the engine: every
    worker is stopped while the running set is read, and the kill comes before they continue."""
    victim_id = f"{stack.key_prefix}-worker{stack.workers.index(victim)}"
    deadline = time.monotonic() + 60
    while True:
        with contextlib.ExitStack() as held:
            for worker in stack.workers:
                held.enter_context(worker.paused())
            if victim_id in stack.running_jobs().values():
                victim.stop(signal.SIGKILL)
                return
        assert time.monotonic() < deadline, f"{victim_id} never ran a line"
        time.sleep(0.02)


def _stored(stack: Stack, batch_id: str) -> dict[str, Any]:
    """The batch's record as the API processes keep it in Redis."""
    store = redis.Redis.from_url(stack.redis_url)
    try:
        return dict(json.loads(store.get(stack.keys.batch(batch_id))))  # type: ignore[arg-type]
    finally:
        store.close()


def _unfinished_lines(stack: Stack, batch_id: str) -> int:
    """Lines not yet enqueued, and enqueued lines whose job has not ended."""
    store = redis.Redis.from_url(stack.redis_url)
    try:
        pending = int(store.llen(stack.keys.batch_pending(batch_id)))  # type: ignore[arg-type]
        job_ids = [raw.decode() for raw in store.hvals(stack.keys.batch_running(batch_id))]  # type: ignore[union-attr]
    finally:
        store.close()
    return pending + sum(stack.job_state(job_id) in ("queued", "running") for job_id in job_ids)


def test_a_background_chat_job_is_polled_to_completion(batch_stack: Stack) -> None:
    client = batch_stack.client()
    created = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "later, please"}],
        max_tokens=8,
        extra_body={"background": True, "ignore_eos": True},
    )
    assert created.id.startswith("chatcmpl-") and created.choices == []
    assert created.status in ("queued", "in_progress", "completed")  # type: ignore[attr-defined]

    deadline = time.monotonic() + 60
    while (done := client.chat.completions.retrieve(created.id)).status != "completed":  # type: ignore[attr-defined]
        assert done.status in ("queued", "in_progress") and time.monotonic() < deadline  # type: ignore[attr-defined]
        time.sleep(0.1)

    assert done.choices[0].message.content and done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert client.chat.completions.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(created.id)


def test_a_background_chat_job_can_be_cancelled(batch_stack: Stack) -> None:
    client = batch_stack.client()
    (worker,) = batch_stack.workers
    with worker.paused():  # the job cannot end before the cancel, however fast the engine
        created = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long one"}],
            max_tokens=200,
            extra_body={"background": True, "ignore_eos": True},
        )
        response = httpx.post(f"{batch_stack.base_url}/v1/chat/completions/{created.id}/cancel")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    assert client.chat.completions.retrieve(created.id).status == "cancelled"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, extra_body={"background": True}
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve("chatcmpl-never-was")


def test_a_text_completions_batch_runs_through_the_same_machinery(batch_stack: Stack) -> None:
    client = batch_stack.client()
    lines = [
        {
            "custom_id": f"t-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"Once upon a time {i}", "max_tokens": 3, "ignore_eos": True},
        }
        for i in range(5)
    ]
    uploaded = client.files.create(file=("text.jsonl", _jsonl(lines)), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")

    batch = _wait(client, created.id, _done)

    assert batch.status == "completed" and batch.request_counts.completed == 5
    outputs = _output_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in outputs] == [f"t-{i}" for i in range(5)]  # input order
    assert all(line["response"]["body"]["object"] == "text_completion" for line in outputs)


def test_a_batch_past_its_window_expires_and_reports_the_unfinished_lines(batch_stack: Stack) -> None:
    client = batch_stack.client()
    created = _submit(client, [_line(f"x-{i}", max_tokens=120) for i in range(64)])
    _wait(client, created.id, lambda b: b.request_counts.completed >= 1)

    # The worker is held while the batch expires, so lines are left for it to report, however
    # fast the engine.
    (worker,) = batch_stack.workers
    with worker.paused():
        assert _unfinished_lines(batch_stack, created.id) > 0
        # Move the deadline into the past, holding the batch's lock as an API process would.
        store = redis.Redis.from_url(batch_stack.redis_url)
        keys = batch_stack.keys
        try:
            while not store.set(keys.batch_lock(created.id), b"test", nx=True, px=5000):
                time.sleep(0.01)
            record = json.loads(store.get(keys.batch(created.id)))  # type: ignore[arg-type]
            record["expires_at"] = int(time.time()) - 1
            store.set(keys.batch(created.id), json.dumps(record))
            store.delete(keys.batch_lock(created.id))
        finally:
            store.close()
        batch = _wait(client, created.id, _done)

    assert batch.status == "expired" and batch.expired_at
    counts = batch.request_counts
    assert counts.completed >= 1 and counts.completed + counts.failed == 64 and counts.failed > 0
    errors = _output_lines(client, batch.error_file_id)
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}
    done = {line["custom_id"] for line in _output_lines(client, batch.output_file_id)}
    assert done.isdisjoint(line["custom_id"] for line in errors)
    assert len(done) + len(errors) == 64


def test_a_batch_only_worker_runs_batch_lines_and_takes_no_requests(
    redis_url: str, log_dir: Path, tiny_model_path: Path
) -> None:
    """``--lanes batch``: a pool that serves batch lines alone (and so may scale to zero); a
    request for its model is refused at once rather than left waiting for it."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(**API_SETTINGS)
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=256, lanes="batch")
        client = stack.client().with_options(max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert refused.value.status_code == 503
        batch = _wait(client, _submit(client, [_line(f"line-{index}") for index in range(3)]).id, _done)
        assert batch.status == "completed" and batch.request_counts is not None
        assert batch.request_counts.completed == 3
    finally:
        stack.stop()
