"""arq payloads are msgpack only: a planted pickle is refused and never executed."""

from __future__ import annotations

import os
import pickle

import pytest

from shared.jobs import ChatJob, decode_job, encode_job
from shared.openai.chat_request import ChatCompletionRequest
from shared.serialization import UnsafePayloadError, deserialize, serialize


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/relaylm-pwned",))


def test_arq_job_dict_round_trips() -> None:
    job = {"t": 1, "f": "run_chat_job", "a": ["chatcmpl-1"], "k": {}, "et": 123}
    assert deserialize(serialize(job)) == job


def test_pickle_is_refused_and_not_executed(tmp_path: object) -> None:
    if os.path.exists("/tmp/relaylm-pwned"):
        os.remove("/tmp/relaylm-pwned")
    with pytest.raises(UnsafePayloadError):
        deserialize(pickle.dumps(_Exploit()))
    assert not os.path.exists("/tmp/relaylm-pwned")


def test_chat_job_round_trips_with_extensions() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "top_k": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        }
    )
    job = ChatJob(job_id="chatcmpl-1", created=1, request=request)
    assert decode_job(encode_job(job)) == job
