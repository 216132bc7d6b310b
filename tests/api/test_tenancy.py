"""Tenancy on a real stack with two keys and an admin key: each file, batch, background job and
resumable stream belongs to the key that created it; another key gets 404 on every route that
names it and never sees it in a list; the admin key sees everything; keys never reach Redis in
clear; per-key limits answer 429 with Retry-After."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.conftest import TINY_MODEL, make_stack
from tests.support.adapters import write_peft_adapter
from tests.support.stack import Stack

KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-9876543210"
ADMIN = "sk-admin-5555555555"
MAX_REQUESTS_PER_KEY = 2
MAX_BATCH_LINES_PER_KEY = 5


@pytest.fixture(scope="module")
def tenants(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(
            api_keys=f"{KEY_A},{KEY_B}", admin_api_keys=ADMIN, max_requests_per_key=MAX_REQUESTS_PER_KEY,
            max_batch_lines_per_key=MAX_BATCH_LINES_PER_KEY, retry_after_s=3, batch_poll_interval_s=0.2,
        )  # fmt: skip
        stack.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=1024)
        yield stack
    finally:
        stack.stop()


def _client(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, headers={"authorization": f"Bearer {key}"}, timeout=60)


def _chat(**fields: object) -> dict[str, object]:
    return {"model": TINY_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


def _upload(client: httpx.Client, num_lines: int, **fields: object) -> str:
    lines = [
        json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": _chat(**fields)})
        for i in range(num_lines)
    ]
    files = {"file": ("in.jsonl", "\n".join(lines).encode(), "application/jsonl")}
    reply = client.post("/v1/files", data={"purpose": "batch"}, files=files)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["id"])


def _create_batch(client: httpx.Client, file_id: str) -> httpx.Response:
    return client.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    )


def _wait_batch(client: httpx.Client, batch_id: str) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return dict(batch)
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not end")


def _is_not_found(reply: httpx.Response) -> bool:
    return reply.status_code == 404 and set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_files_are_seen_only_by_their_key_and_admins(tenants: Stack) -> None:
    with _client(tenants, KEY_A) as a, _client(tenants, KEY_B) as b, _client(tenants, ADMIN) as admin:
        file_id = _upload(a, 2)
        assert a.get(f"/v1/files/{file_id}").status_code == 200
        for reply in (b.get(f"/v1/files/{file_id}"), b.get(f"/v1/files/{file_id}/content"),
                      b.delete(f"/v1/files/{file_id}")):  # fmt: skip
            assert _is_not_found(reply), reply.text
        assert file_id not in [f["id"] for f in b.get("/v1/files").json()["data"]]
        assert file_id in [f["id"] for f in a.get("/v1/files").json()["data"]]
        assert file_id in [f["id"] for f in admin.get("/v1/files").json()["data"]]
        assert admin.get(f"/v1/files/{file_id}/content").status_code == 200
        assert "owner" not in a.get(f"/v1/files/{file_id}").json()
        assert a.delete(f"/v1/files/{file_id}").status_code == 200


def test_batches_and_their_output_files_belong_to_the_key_that_created_them(tenants: Stack) -> None:
    with _client(tenants, KEY_A) as a, _client(tenants, KEY_B) as b, _client(tenants, ADMIN) as admin:
        file_id = _upload(a, 2)
        assert _is_not_found(_create_batch(b, file_id))  # another key's input file does not exist for B
        created = _create_batch(a, file_id)
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        assert "owner" not in created.json() and "num_lines" not in created.json()
        assert _is_not_found(b.get(f"/v1/batches/{batch_id}"))
        assert _is_not_found(b.post(f"/v1/batches/{batch_id}/cancel"))
        assert batch_id not in [x["id"] for x in b.get("/v1/batches").json()["data"]]
        assert batch_id in [x["id"] for x in admin.get("/v1/batches").json()["data"]]
        batch = _wait_batch(a, batch_id)
        assert batch["status"] == "completed", batch
        output_id = batch["output_file_id"]
        assert a.get(f"/v1/files/{output_id}/content").text.count("\n") == 2
        assert _is_not_found(b.get(f"/v1/files/{output_id}/content"))
        assert admin.get(f"/v1/batches/{batch_id}").json()["status"] == "completed"


def test_background_jobs_belong_to_the_key_that_submitted_them(tenants: Stack) -> None:
    with _client(tenants, KEY_A) as a, _client(tenants, KEY_B) as b, _client(tenants, ADMIN) as admin:
        job_id = a.post("/v1/chat/completions", json=_chat(background=True)).json()["id"]
        assert _is_not_found(b.get(f"/v1/chat/completions/{job_id}"))
        assert _is_not_found(b.post(f"/v1/chat/completions/{job_id}/cancel"))
        assert _is_not_found(b.delete(f"/v1/chat/completions/{job_id}"))
        deadline = time.monotonic() + 30
        while (polled := a.get(f"/v1/chat/completions/{job_id}").json())["status"] != "completed":
            assert time.monotonic() < deadline, polled
            time.sleep(0.2)
        # Once its result is stored, it is still A's alone.
        assert _is_not_found(b.get(f"/v1/chat/completions/{job_id}"))
        assert _is_not_found(b.delete(f"/v1/chat/completions/{job_id}"))
        assert admin.get(f"/v1/chat/completions/{job_id}").json()["status"] == "completed"
        assert a.delete(f"/v1/chat/completions/{job_id}").status_code == 200


def test_a_resumable_stream_resumes_only_for_its_key(tenants: Stack) -> None:
    client_a = openai.OpenAI(base_url=f"{tenants.base_url}/v1", api_key=KEY_A, max_retries=0)
    stream = client_a.chat.completions.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        extra_body={"resumable": True},
    )  # fmt: skip
    job_id = next(iter(stream)).id
    for _ in stream:
        pass
    with _client(tenants, KEY_A) as a, _client(tenants, KEY_B) as b:
        assert _is_not_found(b.get(f"/v1/chat/completions/{job_id}/stream"))
        # Not even a bad Last-Event-ID tells B that the job exists.
        assert _is_not_found(b.get(f"/v1/chat/completions/{job_id}/stream", headers={"last-event-id": "999"}))
        resumed = a.get(f"/v1/chat/completions/{job_id}/stream")
        assert resumed.status_code == 200 and resumed.text.rstrip().endswith("data: [DONE]")


def test_keys_never_reach_redis_in_clear(tenants: Stack) -> None:
    with _client(tenants, KEY_A) as a:
        _upload(a, 1)
        job_id = a.post("/v1/chat/completions", json=_chat(background=True)).json()["id"]
        deadline = time.monotonic() + 30
        while a.get(f"/v1/chat/completions/{job_id}").json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    client = redis.Redis.from_url(tenants.redis_url)
    try:
        for key in client.scan_iter(f"{tenants.key_prefix}:*"):
            dumped = client.dump(key) or b""
            assert b"sk-tenant" not in key and b"sk-tenant" not in dumped, key
            assert b"sk-admin" not in dumped, key
    finally:
        client.close()


def test_a_key_past_its_open_request_limit_gets_429_and_others_are_served(tenants: Stack) -> None:
    long_stream = _chat(stream=True, max_tokens=600, ignore_eos=True)
    with _client(tenants, KEY_A) as a, _client(tenants, KEY_B) as b:
        with (
            a.stream("POST", "/v1/chat/completions", json=long_stream) as first,
            a.stream("POST", "/v1/chat/completions", json=long_stream) as second,
        ):
            assert first.status_code == second.status_code == 200
            refused = a.post("/v1/chat/completions", json=_chat())
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert refused.headers["retry-after"] == "3"
            assert b.post("/v1/chat/completions", json=_chat()).status_code == 200
        # Closing the streams cancels their jobs, which frees the key's slots.
        deadline = time.monotonic() + 10
        while (reply := a.post("/v1/chat/completions", json=_chat())).status_code == 429:
            assert time.monotonic() < deadline, reply.text
            time.sleep(0.2)
        assert reply.status_code == 200


def test_a_key_past_its_batch_line_limit_gets_429_and_others_are_served(tenants: Stack) -> None:
    with _client(tenants, KEY_A) as a, _client(tenants, KEY_B) as b:
        second_file = _upload(a, 4)
        # Long lines: the first batch is still running when the second is asked for.
        first = _create_batch(a, _upload(a, 4, max_tokens=400, ignore_eos=True))
        assert first.status_code == 200, first.text
        refused = _create_batch(a, second_file)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in refused.headers
        assert _create_batch(b, _upload(b, 4)).status_code == 200
        assert _wait_batch(a, first.json()["id"])["status"] == "completed"
        assert _create_batch(a, second_file).status_code == 200


def test_only_admin_keys_load_and_unload_lora_adapters(tenants: Stack, tiny_model_path: Path, tmp_path: Path) -> None:
    folder = write_peft_adapter(tiny_model_path, tmp_path / "tenant-tone", seed=1)
    body = {"lora_name": "tenant-tone", "lora_path": str(folder)}
    with _client(tenants, KEY_A) as client, _client(tenants, ADMIN) as admin:
        refused = client.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        assert admin.post("/v1/load_lora_adapter", json=body).status_code == 200
        # Any key may use it: it is a model now.
        answer = client.post("/v1/chat/completions", json=_chat(model="tenant-tone"))
        assert answer.status_code == 200 and answer.json()["model"] == "tenant-tone"
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "tenant-tone"}).status_code == 403
        assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "tenant-tone"}).status_code == 200
