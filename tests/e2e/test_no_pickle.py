"""Anyone who can write to Redis must not get code execution: planted pickles are refused."""

from __future__ import annotations

import os
import pickle
import time
import uuid
from pathlib import Path

import redis
from arq.constants import job_key_prefix
from arq.jobs import serialize_job

from shared import serialization
from shared.jobs import CHAT_JOB_FUNCTION
from tests.conftest import TINY_MODEL
from tests.support.stack import Stack


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _wait_for_log(stack: Stack, text: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in stack.workers[0].log():
            return True
        time.sleep(0.1)
    return False


def _plant(stack: Stack, job_id: str, arq_record: bytes, request_payload: bytes | None = None) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        if request_payload is not None:
            client.set(stack.keys.job_request(job_id), request_payload, ex=60)
        client.psetex(job_key_prefix + job_id, 60_000, arq_record)
        client.zadd(stack.keys.queue(TINY_MODEL), {job_id: 1})  # arq skips a falsy score
        client.publish(stack.keys.queue_wake_channel(TINY_MODEL), b"")
    finally:
        client.close()


def test_a_pickled_arq_job_is_refused_not_executed(tiny_stack: Stack, tmp_path: Path) -> None:
    marker = tmp_path / "pwned-by-arq-job"
    job_id = f"planted-{uuid.uuid4().hex}"
    record = pickle.dumps({"t": 1, "f": CHAT_JOB_FUNCTION, "a": [_Exploit(marker)], "k": {}, "et": 0})
    _plant(tiny_stack, job_id, record)
    assert _wait_for_log(tiny_stack, "refused a non-msgpack payload")
    assert not marker.exists()
    reply = tiny_stack.client().chat.completions.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert reply.choices  # the worker still serves


def test_a_pickled_request_payload_is_refused_not_executed(tiny_stack: Stack, tmp_path: Path) -> None:
    marker = tmp_path / "pwned-by-payload"
    job_id = f"planted-{uuid.uuid4().hex}"
    record = serialize_job(CHAT_JOB_FUNCTION, (job_id,), {}, None, 0, serializer=serialization.serialize)
    _plant(tiny_stack, job_id, record, request_payload=pickle.dumps(_Exploit(marker)))
    assert _wait_for_log(tiny_stack, f"job {job_id}: refused a request payload")
    assert not marker.exists()
