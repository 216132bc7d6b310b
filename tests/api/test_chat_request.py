"""Request validation rules that go beyond field types, and what a request's fields make of its job."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.jobs.build import make_job
from api.tenancy import Tenant
from api.wire.openai.chat_request import ChatCompletionRequest
from api.wire.responses import ResponsesRequest, to_chat_request

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**BASE, **fields})


def test_defaults_follow_openai() -> None:
    request = _request()
    assert (request.temperature, request.top_p, request.n, request.stream) == (1.0, 1.0, 1, False)
    assert request.max_new_tokens is None and request.stop_sequences == []


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert _request(max_tokens=10, max_completion_tokens=3).max_new_tokens == 3
    assert _request(max_tokens=10).max_new_tokens == 10


def test_stop_accepts_a_string_or_up_to_four() -> None:
    assert _request(stop="x").stop_sequences == ["x"]
    assert _request(stop=["a", "b", "c", "d"]).stop_sequences == ["a", "b", "c", "d"]
    for bad in (["a"] * 5, "", ["ok", ""]):
        with pytest.raises(ValidationError):
            _request(stop=bad)


@pytest.mark.parametrize(
    "fields",
    [
        {"top_logprobs": 2},
        {"stream_options": {"include_usage": True}},
        {"logit_bias": {"abc": 1.0}},
        {"logit_bias": {"5": 101.0}},
        {"messages": [{"role": "assistant"}]},
        {"messages": [{"role": "tool", "content": "x"}]},
    ],
)
def test_cross_field_rules_reject(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        _request(**fields)


def test_assistant_with_tool_calls_may_have_null_content() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = _request(messages=[{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert request.messages[0].tool_calls[0].function.name == "f"  # type: ignore[union-attr]


def test_unknown_fields_are_ignored() -> None:
    assert _request(store=True, metadata={"a": "b"}).model == "m"


def test_a_priority_orders_only_its_keys_jobs_unless_the_key_may_rank_across_keys() -> None:
    urgent = _request(priority=-7)
    plain = make_job(urgent, "r", True, Tenant("owner-1", is_admin=False, weight=3.0))
    ranked = make_job(urgent, "r", True, Tenant("owner-2", is_admin=False, ranks_across_tenants=True))
    assert (plain.queue_priority, plain.share_band, plain.share_weight) == (-7, 0, 3.0)
    assert (ranked.queue_priority, ranked.share_band, ranked.share_weight) == (-7, -7, 1.0)
    responses = ResponsesRequest.model_validate({"model": "m", "input": "hi", "priority": 3})
    assert to_chat_request(responses, []).priority == 3
    for bad in (-1001, 1001, 1.5):
        with pytest.raises(ValidationError):
            _request(priority=bad)
