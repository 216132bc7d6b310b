"""schemathesis against the served OpenAPI schema, over every route: whatever it sends, no 5xx,
every answer has a status, content type and body the schema documents, and every error is
OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``).

Drives schemathesis' per-operation hypothesis strategies directly (its pytest plugin does not
support this pytest version)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import make_stack
from tests.support.stack import Stack

FUZZ_MODEL = "fuzz-tiny"


@pytest.fixture(scope="module")
def fuzz_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    # A small context bounds every generated request's work (max_tokens defaults to what is left).
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        stack.start_worker(tiny_model_path, FUZZ_MODEL, dtype="float32", max_model_len=64)
        yield stack
    finally:
        stack.stop()


def test_no_request_makes_the_server_fail(fuzz_stack: Stack) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_stack.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for operation in operations:
        _fuzz_operation(operation, fuzz_stack.base_url)


@schemathesis.check
def openai_error_shape(ctx: object, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """Every 4xx and 5xx body is exactly an OpenAI error object (Anthropic's on its API's routes)."""
    if response.status_code < 400:
        return None
    body = response.json()
    if case.operation.path.startswith("/v1/messages"):
        if not (isinstance(body, dict) and body.get("type") == "error" and set(body) == {"type", "error"}):
            raise AssertionError(f"{response.status_code} body is not Anthropic's error: {response.text[:300]}")
        if set(body["error"]) != {"type", "message"} or not body["error"]["message"]:
            raise AssertionError(f"{response.status_code} error fields are not Anthropic's: {response.text[:300]}")
        return True
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)):
        raise AssertionError(f"{response.status_code} body is not {{'error': ...}}: {response.text[:300]}")
    if set(body["error"]) != {"message", "type", "param", "code"} or not body["error"]["message"]:
        raise AssertionError(f"{response.status_code} error fields are not OpenAI's: {response.text[:300]}")
    return True


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    openai_error_shape,
]


def _fuzz_operation(operation: schemathesis.APIOperation, base_url: str) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = FUZZ_MODEL  # reach the worker, not only the 404 path
        if operation.path == "/ready":  # 503 is its documented answer for "not ready"
            assert case.call(base_url=base_url, timeout=30).status_code in (200, 503)
        else:
            case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=30)

    fuzz()
