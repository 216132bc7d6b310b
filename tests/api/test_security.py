"""API keys, CORS, body limits, text hygiene, request limits, queue backpressure and prompt logging,
against real API and worker processes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from api.settings import ApiKey, ApiSettings
from tests.conftest import TINY_MODEL, make_stack
from tests.support.stack import Stack

KEY = "sk-test-key-1"
ORIGIN = "https://app.example"
SECRET_PROMPT = "my-secret-prompt-text"


@pytest.fixture(scope="module")
def secured(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(
            api_keys=f"{KEY},other-key", cors_allow_origins=ORIGIN, max_body_bytes=4096, max_messages=5,
            max_pending_per_model=2, retry_after_s=3,
        )  # fmt: skip
        stack.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=1024)
        yield stack
    finally:
        stack.stop()


def _post(stack: Stack, body: bytes | dict[str, object], key: str | None = KEY, **headers: str) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers.setdefault("content-type", "application/json")
    return httpx.post(f"{stack.base_url}/v1/chat/completions", content=content, headers=headers, timeout=30)


def _body(**fields: object) -> dict[str, object]:
    return {"model": TINY_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_requests_need_a_valid_key(secured: Stack) -> None:
    assert _error(_post(secured, _body(), key=None), 401)["code"] == "invalid_api_key"
    assert _post(secured, _body(), key="wrong").status_code == 401
    assert _post(secured, _body(), key=KEY).status_code == 200
    assert _post(secured, _body(), key="other-key").status_code == 200
    for path in ("/v1/models", "/ready", "/openapi.json"):
        assert httpx.get(f"{secured.base_url}{path}").status_code == 401
    assert httpx.get(f"{secured.base_url}/health").status_code == 200


def test_the_openai_client_authenticates_with_its_api_key(secured: Stack) -> None:
    client = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key=KEY, max_retries=0)
    assert client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_cors_preflight_is_answered_for_allowed_origins(secured: Stack) -> None:
    headers = {
        "origin": ORIGIN,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization",
    }
    response = httpx.options(f"{secured.base_url}/v1/chat/completions", headers=headers)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{secured.base_url}/v1/chat/completions", headers={**headers, "origin": "https://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers


def test_oversized_bodies_are_413(secured: Stack) -> None:
    big = _body(messages=[{"role": "user", "content": "x" * 5000}])
    assert _error(_post(secured, big), 413)["code"] == "payload_too_large"


def test_invalid_utf8_and_lone_surrogates_are_400(secured: Stack) -> None:
    assert "UTF-8" in _error(_post(secured, b'{"model": "\xff\xfe"}'), 400)["message"]
    raw = json.dumps(_body()).replace('"hi"', '"a\\ud800b"').encode()
    error = _error(_post(secured, raw), 400)
    assert error["param"] == "messages.0.content"
    paired = json.dumps(_body()).replace('"hi"', '"\\ud83d\\ude00"').encode()  # a real emoji, escaped
    assert _post(secured, paired).status_code == 200


def test_wrong_types_name_their_param_and_too_many_messages_are_refused(secured: Stack) -> None:
    assert _error(_post(secured, _body(temperature="hot")), 400)["param"] == "temperature"
    many = _body(messages=[{"role": "user", "content": "x"}] * 6)
    assert _error(_post(secured, many), 400)["param"] == "messages"


def test_a_full_queue_answers_429_with_retry_after(secured: Stack) -> None:
    long = _body(max_tokens=900, ignore_eos=True, stream=True)
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30, headers=headers) as client:
        streams = [client.stream("POST", f"{secured.base_url}/v1/chat/completions", json=long) for _ in range(2)]
        responses = [stream.__enter__() for stream in streams]
        try:
            assert all(response.status_code == 200 for response in responses)
            refused = _post(secured, _body())
            assert _error(refused, 429)["code"] == "queue_full"
            assert refused.headers["retry-after"] == "3"
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
    # The two long jobs were cancelled when their clients left: room again, soon.
    deadline = time.monotonic() + 10
    while _post(secured, _body()).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _post(secured, _body()).status_code == 200


def test_prompts_stay_out_of_logs_unless_enabled(
    secured: Stack, redis_url: str, log_dir: Path, tiny_model_path: Path
) -> None:
    assert _post(secured, _body(messages=[{"role": "user", "content": SECRET_PROMPT}])).status_code == 200
    assert secured.api is not None
    assert SECRET_PROMPT not in secured.api.log()
    assert SECRET_PROMPT not in secured.workers[0].log()
    verbose = make_stack(redis_url, log_dir)
    try:
        verbose.start_api(log_prompts="true")
        verbose.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=256)
        response = httpx.post(
            f"{verbose.base_url}/v1/chat/completions", json=_body(messages=[{"role": "user", "content": SECRET_PROMPT}])
        )
        assert response.status_code == 200
        assert verbose.api is not None and SECRET_PROMPT in verbose.api.log()
    finally:
        verbose.stop()


def test_api_keys_can_come_from_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-a\n\n  sk-b  weight=3 priority=global\n")
    settings = ApiSettings(api_keys="sk-c", api_key_file=key_file)
    assert settings.load_api_keys() == [ApiKey("sk-c"), ApiKey("sk-a"), ApiKey("sk-b", 3.0, True)]


@pytest.mark.parametrize(
    ("line", "complaint"),
    [("sk-a weight=0", "weight must be"), ("sk-a weight=lots", "weight must be"), ("sk-a priority=high", "unknown")],
)
def test_a_key_file_line_it_cannot_read_stops_the_server_naming_the_line(
    tmp_path: Path, line: str, complaint: str
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"sk-ok\n{line}\n")
    with pytest.raises(ValueError, match=f"keys:2: {complaint}"):
        ApiSettings(api_key_file=key_file).load_api_keys()
