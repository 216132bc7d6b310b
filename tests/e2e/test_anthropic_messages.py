"""The Anthropic Messages API, driven by the official ``anthropic`` SDK against a real stack
(API key sent as ``x-api-key``): create and stream, a forced tool call and the tool-result turn
after it, and errors in Anthropic's shape. The model is a tiny random Qwen3 (a fake, named as
such): forced tool choice holds on it because the constrained decoder enforces it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import make_stack
from tests.support.qwen import tiny_random_qwen3_dir
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

MODEL = "qwen-random-messages"
KEY = "sk-ant-local-test"
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
HELLO: Any = [{"role": "user", "content": "hello"}]
NO_THINKING: Any = {"type": "disabled"}
# This SDK version has no `temperature` argument; the API takes the field (0 to 1) all the same.
GREEDY: Any = {"temperature": 0}


@pytest.fixture(scope="module")
def messages_stack(redis_url: str, log_dir: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(api_keys=KEY)
        stack.start_worker(tiny_random_qwen3_dir("qwen3"), MODEL, dtype="float32", max_model_len=1024)
        yield stack
    finally:
        stack.stop()


def _client(stack: Stack, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key=key, max_retries=0)


def test_a_message_is_created_with_usage(messages_stack: Stack) -> None:
    message = _client(messages_stack).messages.create(
        model=MODEL, max_tokens=8, messages=HELLO, system="Be brief.", thinking=NO_THINKING, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 5 and 1 <= message.usage.output_tokens <= 8


def test_a_matched_stop_sequence_is_named_in_the_message_and_the_stream(messages_stack: Stack) -> None:
    client = _client(messages_stack)
    free = client.messages.create(
        model=MODEL, max_tokens=16, messages=HELLO, thinking=NO_THINKING, extra_body=GREEDY
    )  # fmt: skip
    text = "".join(block.text for block in free.content if block.type == "text")
    stop = text[-3:]  # greedy: the same text comes again, and this ends it
    assert len(stop) == 3, f"the model wrote too little to cut: {text!r}"
    kwargs: Any = {"model": MODEL, "max_tokens": 16, "messages": HELLO, "thinking": NO_THINKING}
    stopped = client.messages.create(**kwargs, stop_sequences=["never-written", stop], extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stop not in "".join(block.text for block in stopped.content if block.type == "text")
    with client.messages.stream(**kwargs, stop_sequences=[stop], extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_a_streamed_message_is_the_documented_event_sequence(messages_stack: Stack) -> None:
    with _client(messages_stack).messages.stream(
        model=MODEL, max_tokens=12, messages=HELLO, thinking=NO_THINKING, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    names = [event.type for event in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names.index("content_block_start") < names.index("content_block_stop") < names.index("message_delta")
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.usage.output_tokens >= 1 and final.stop_reason in ("end_turn", "max_tokens")
    # The same request, not streamed, gives the same text (greedy decoding).
    same = _client(messages_stack).messages.create(
        model=MODEL, max_tokens=12, messages=HELLO, thinking=NO_THINKING, extra_body=GREEDY
    )
    assert same.content[0].type == "text" and same.content[0].text == text


def test_a_forced_tool_call_and_the_tool_result_turn_after_it(messages_stack: Stack) -> None:
    client = _client(messages_stack)
    message = client.messages.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice={"type": "any"}, thinking=NO_THINKING,
    )  # fmt: skip
    calls = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].input in ({"city": "Paris"}, {"city": "Oslo"})
    follow_up = client.messages.create(
        model=MODEL, max_tokens=8, tools=[WEATHER], thinking=NO_THINKING,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [block.model_dump() for block in message.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny"}]},
        ],
    )  # fmt: skip
    assert follow_up.type == "message" and follow_up.usage.input_tokens > message.usage.input_tokens


def test_a_streamed_forced_tool_call_arrives_as_input_json_deltas(messages_stack: Stack) -> None:
    with _client(messages_stack).messages.stream(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, thinking=NO_THINKING,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    fragments = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert fragments
    [call] = [block for block in final.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input in ({"city": "Paris"}, {"city": "Oslo"})
    assert final.stop_reason == "tool_use"


def test_count_tokens_equals_the_input_tokens_the_request_reports(messages_stack: Stack) -> None:
    client = _client(messages_stack)
    conversation: Any = {
        "model": MODEL, "system": "You are terse.", "tools": [WEATHER], "thinking": NO_THINKING,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
    }  # fmt: skip
    counted = client.messages.count_tokens(**conversation)
    reported = client.messages.create(max_tokens=3, **conversation)
    assert counted.input_tokens == reported.usage.input_tokens > 20
    # A forced tool choice renders the prompt differently (no thinking block): counted the same way.
    forced = {**conversation, "tool_choice": {"type": "any"}}
    assert client.messages.count_tokens(**forced).input_tokens == (
        client.messages.create(max_tokens=40, **forced).usage.input_tokens
    )


def test_errors_come_in_anthropics_shape(messages_stack: Stack) -> None:
    client = _client(messages_stack)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=5, messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(
            model=MODEL, max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}],
        )  # fmt: skip
    assert image.value.body["type"] == "error"  # type: ignore[index]
    assert image.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        _client(messages_stack, key="wrong").messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert unauthorized.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # No max_tokens (the SDK insists on it, so raw HTTP): Anthropic's shape, the field named.
    raw = httpx.post(
        f"{messages_stack.base_url}/v1/messages", headers={"x-api-key": KEY}, json={"model": MODEL, "messages": HELLO}
    )
    assert raw.status_code == 400 and set(raw.json()) == {"type", "error"}
    assert "max_tokens" in raw.json()["error"]["message"]
