"""Request validation rules that go beyond field types."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.wire.openai.chat_request import ChatCompletionRequest

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
