"""Raw HTTP: every bad input gets an OpenAI-shaped error with the right status."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import TINY_MODEL
from tests.support.stack import Stack


def _post(stack: Stack, content: bytes | str, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions", content=content, headers={"content-type": content_type}, timeout=30
    )


def _assert_error_shape(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ("{not json", None),
        ("[1, 2]", None),
        ('{"model": "x"}', "messages"),
        (f'{{"model": "{TINY_MODEL}", "messages": "hi"}}', "messages"),
        (f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user"}}]}}', "messages.0.user.content"),
        (f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": "x"}}], "n": 0}}', "n"),
        (f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": "x"}}], "top_p": 0}}', "top_p"),
        (
            f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": "x"}}], "max_tokens": "lots"}}',
            "max_tokens",
        ),
        (
            f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": [{{"type": "image_url"}}]}}]}}',
            "messages.0.user.content",
        ),
        (
            f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "tool", "content": "x"}}]}}',
            "messages.0.tool.tool_call_id",
        ),
        # OpenAI rejects an empty content array.
        (f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": []}}]}}', "messages.0.user.content"),
        # Token ids: negative ones in the schema; past the vocabulary by the worker, before the stream starts.
        (f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": "x"}}], "logit_bias": {{"-1": 1}}}}',
         "logit_bias"),
        (f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": "x"}}], "stream": true, '
         '"logit_bias": {"99999999": 1}}', "logit_bias"),
        # A lone surrogate in an object key (metadata, a schema property name) is named in the path, escaped.
        (f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": "x"}}], '
         '"metadata": {"\\ud800": "v"}}', "metadata.\\ud800"),
        (f'{{"model": "{TINY_MODEL}", "messages": [{{"role": "user", "content": "x"}}], "response_format": '
         '{"type": "json_schema", "json_schema": {"name": "s", "schema": {"properties": {"\\udfff": {}}}}}}',
         "response_format.json_schema.schema.properties.\\udfff"),
    ],
)  # fmt: skip
def test_invalid_bodies_are_400_with_param(tiny_stack: Stack, payload: str, param: str | None) -> None:
    error = _assert_error_shape(_post(tiny_stack, payload), 400)
    assert error["type"] == "invalid_request_error"
    if param is None:
        assert error["param"] is None
    else:
        assert isinstance(error["param"], str) and error["param"].startswith(param)


def test_unknown_fields_are_ignored(tiny_stack: Stack) -> None:
    payload = json.dumps(
        {"model": TINY_MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "store": True, "foo": 1}
    )
    assert _post(tiny_stack, payload).status_code == 200


def test_unknown_route_and_wrong_method_are_openai_errors(tiny_stack: Stack) -> None:
    _assert_error_shape(httpx.get(f"{tiny_stack.base_url}/v1/nothing-here"), 404)
    _assert_error_shape(httpx.get(f"{tiny_stack.base_url}/v1/chat/completions"), 405)


def test_health_and_readiness(tiny_stack: Stack) -> None:
    assert httpx.get(f"{tiny_stack.base_url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{tiny_stack.base_url}/ready", params={"model": TINY_MODEL})
    assert ready.status_code == 200
    assert ready.json()["ready_workers"] == {TINY_MODEL: 1}
    assert httpx.get(f"{tiny_stack.base_url}/ready", params={"model": "absent"}).status_code == 503


def test_sse_wire_format_is_data_lines_ending_with_done(tiny_stack: Stack) -> None:
    body = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{tiny_stack.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert len(data) >= 3
