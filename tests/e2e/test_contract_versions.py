"""A rolling upgrade, both ways, on real processes: a job an API of the previous release queued
(job contract version 3) runs on this release's worker, and while a worker of that release is
live for a model, this API writes that model's jobs in version 3. Either way the client gets
the text an undisturbed request gets."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from api.jobs.worker_directory import LIVE_ANSWER_REUSE_S
from shared.job_lifecycle import JobLifecycle
from shared.redis_keys import WORKER_HEARTBEAT_TTL_S
from shared.registry import WorkerInfo
from tests.conftest import TINY_MODEL
from tests.support.stack import Stack

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def _reference_text(stack: Stack) -> str:
    response = stack.client().chat.completions.create(
        model=TINY_MODEL, messages=MESSAGES, temperature=0, max_tokens=8, extra_body={"ignore_eos": True}
    )
    return response.choices[0].message.content or ""


def _streamed_text(stack: Stack, job_id: str) -> str:
    """The job's stream, read through the API's reconnect route from its first event."""
    text = []
    with httpx.stream("GET", f"{stack.base_url}/v1/chat/completions/{job_id}/stream", timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            text.extend(choice["delta"].get("content") or "" for choice in chunk["choices"])
    return "".join(text)


def test_a_job_queued_by_the_previous_release_runs_on_this_worker(tiny_stack: Stack, redis_url: str) -> None:
    """The payload is what an API of the previous release wrote: version 3, with its delivery
    and every sampling field it had."""
    job_id = f"chatcmpl-v3-{uuid.uuid4().hex[:8]}"
    sampling = {
        "n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": None, "logit_bias": [], "logprobs": None,
        "max_tokens": 8, "max_tokens_param": "max_tokens", "min_tokens": 0, "ignore_eos": True, "stop": [],
        "stop_token_ids": [], "skip_special_tokens": True,
    }  # fmt: skip
    payload = {
        "version": 3, "job_id": job_id, "request_id": job_id, "created": int(time.time()), "tenant": None,
        "delivery": {"stream": True, "include_usage": False, "resumable": True, "background": False, "echo": False,
                     "encoding_format": "float"},
        "kind": "chat",
        "request": {
            "task": "generate", "model": TINY_MODEL,
            "messages": [{**message, "tool_calls": [], "tool_call_id": None, "reasoning_content": None}
                         for message in MESSAGES],
            "prompts": None, "tools": [], "tool_choice": "auto", "tool_name": None, "parallel_tool_calls": True,
            "output": None, "chat_template_kwargs": {}, "sampling": sampling, "priority": 0,
        },
    }  # fmt: skip
    keys = tiny_stack.keys

    async def enqueue() -> None:
        connection = AsyncRedis.from_url(redis_url)
        try:
            await JobLifecycle(connection, keys).create(
                job_id, json.dumps(payload).encode(), TINY_MODEL, keys.queue(TINY_MODEL)
            )
        finally:
            await connection.aclose()

    asyncio.run(enqueue())  # queued and its model's workers woken, as the API does
    assert _streamed_text(tiny_stack, job_id) == _reference_text(tiny_stack)


@pytest.fixture
def previous_release_worker(tiny_stack: Stack, redis_url: str) -> Iterator[None]:
    """A live registry record of a worker of the previous release for the tiny model (it reads
    up to version 3; it claims nothing, so this release's worker serves the jobs)."""
    client = redis.Redis.from_url(redis_url)
    keys = tiny_stack.keys
    worker_id = f"previous-release-{uuid.uuid4().hex[:6]}"
    info = WorkerInfo(
        worker_id=worker_id, model=TINY_MODEL, state="ready", host="elsewhere", pid=1, started_at=time.time(),
        heartbeat_at=time.time(), contract_version=3,
    ).model_dump()  # fmt: skip
    client.set(keys.worker(worker_id), json.dumps(info), ex=WORKER_HEARTBEAT_TTL_S * 4)
    client.sadd(keys.model_workers(TINY_MODEL), worker_id)
    # An API process reuses its registry reading for LIVE_ANSWER_REUSE_S: the next one sees this worker.
    time.sleep(LIVE_ANSWER_REUSE_S + 0.2)
    try:
        yield
    finally:
        client.delete(keys.worker(worker_id))
        client.srem(keys.model_workers(TINY_MODEL), worker_id)


def test_jobs_are_written_in_version_3_while_a_previous_release_worker_is_live(
    tiny_stack: Stack, redis_url: str, previous_release_worker: None
) -> None:
    reference = _reference_text(tiny_stack)
    client = tiny_stack.client()
    stream = client.chat.completions.create(
        model=TINY_MODEL, messages=MESSAGES, stream=True, temperature=0, max_tokens=8,
        extra_body={"ignore_eos": True, "resumable": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference
    payload = redis.Redis.from_url(redis_url).hget(tiny_stack.keys.job(chunks[0].id), "request")
    assert payload is not None
    assert json.loads(payload)["version"] == 3  # what a worker of the previous release reads
    # A field the previous release does not have, set: not written for its worker (its text would
    # differ), so the client is told to retry once the model's workers are upgraded.
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(
            model=TINY_MODEL, messages=MESSAGES, max_tokens=8, stop=["."],
            extra_body={"include_stop_str_in_output": True},
        )  # fmt: skip
    assert raised.value.status_code == 503
    assert "include_stop_str_in_output" in raised.value.message
