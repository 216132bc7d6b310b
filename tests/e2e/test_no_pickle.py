"""Anyone who can write to Redis must not get code execution: planted pickles are refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import time
import uuid
from pathlib import Path

import httpx
import redis

from shared.job_lifecycle import JobLifecycle
from tests.conftest import TINY_MODEL
from tests.support.stack import SETTLE_TIMEOUT_S, Stack


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _wait_for_log(stack: Stack, text: str, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in stack.workers[0].log():
            return True
        time.sleep(0.1)
    return False


async def _plant_job(stack: Stack, job_id: str, payload: bytes) -> None:
    client = redis.asyncio.Redis.from_url(stack.redis_url)
    try:
        await JobLifecycle(client, stack.keys).create(job_id, payload, TINY_MODEL, stack.keys.queue(TINY_MODEL))
    finally:
        await client.aclose()


def test_a_pickled_request_payload_is_refused_not_executed(tiny_stack: Stack, tmp_path: Path) -> None:
    marker = tmp_path / "pwned-by-payload"
    job_id = f"planted-{uuid.uuid4().hex}"
    asyncio.run(_plant_job(tiny_stack, job_id, pickle.dumps(_Exploit(marker))))
    assert _wait_for_log(tiny_stack, f"job {job_id}: refused a request payload")
    assert not marker.exists()
    reply = tiny_stack.client().chat.completions.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert reply.choices  # the worker still serves


def test_a_pickle_published_on_a_jobs_channel_ends_its_stream_and_runs_nothing(
    tiny_stack: Stack, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned-by-event"
    body = {
        "model": TINY_MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
        "max_tokens": 400, "ignore_eos": True,
    }  # fmt: skip
    data: list[str] = []
    (worker,) = tiny_stack.workers
    url = f"{tiny_stack.base_url}/v1/chat/completions"
    with contextlib.ExitStack() as held, httpx.stream("POST", url, json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
                if len(data) == 2:
                    # The worker is held, so the planted message comes before the job's end
                    # however fast the CPU.
                    held.enter_context(worker.paused())
                    job_id = json.loads(data[-1])["id"]
                    client = redis.Redis.from_url(tiny_stack.redis_url)
                    client.publish(tiny_stack.keys.job_events_channel(job_id), pickle.dumps(_Exploit(marker)))
                    client.close()
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "event_unreadable"
    assert not marker.exists()
