"""Tool calling, reasoning and structured output through API + Redis + worker, with real Qwen3
tokenizers and templates: a tiny Qwen3 trained in a fixture to answer with a tool call (real
generation, not a fake), and random-weight models forced by constrained decoding."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import TINY_MODEL, make_stack
from tests.support.qwen import TOOL_CALL_MESSAGES, TOOL_CALL_TOOLS, tiny_random_qwen3_dir, tiny_tool_calling_qwen3_dir
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

TRAINED, RANDOM, CODER = "qwen-trained", "qwen-random", "qwen-coder-random"
# Random weights never choose to close an unbounded string, so the schemas that random models
# fill in bound their strings (enums, maxLength) and arrays; the grammar then has to end them.
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_products",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "enum": ["shoes", "boots", "socks"]},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                "in_stock": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "blue"]}, "maxItems": 2},
            },
            "required": ["query", "limit"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def qwen_stack(redis_url: str, log_dir: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        settings = {"dtype": "float32", "max_model_len": 1024}
        stack.start_worker(tiny_tool_calling_qwen3_dir(), TRAINED, **settings)
        stack.start_worker(tiny_random_qwen3_dir("qwen3"), RANDOM, **settings)
        stack.start_worker(tiny_random_qwen3_dir("qwen3_coder"), CODER, **settings)
        yield stack
    finally:
        stack.stop()


def test_a_trained_model_answers_with_a_tool_call(qwen_stack: Stack) -> None:
    reply = qwen_stack.client().chat.completions.create(
        model=TRAINED, messages=TOOL_CALL_MESSAGES, tools=TOOL_CALL_TOOLS, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_call_follows_openai_rules_and_the_sdk_reassembles_it(qwen_stack: Stack) -> None:
    client = qwen_stack.client()
    kwargs: dict[str, Any] = {
        "model": TRAINED,
        "messages": TOOL_CALL_MESSAGES,
        "tools": TOOL_CALL_TOOLS,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    fragments = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    first, rest = fragments[0], fragments[1:]
    assert (
        first.id
        and first.type == "function"
        and first.function.name == "get_weather"
        and first.function.arguments == ""
    )
    assert rest and all(f.id is None and f.function.name is None for f in rest)
    assert len(rest) > 1, "arguments should stream in pieces, not as one blob"
    assert "".join(f.function.arguments for f in rest) == whole.function.arguments
    assert not any(chunk.choices[0].delta.content for chunk in chunks if chunk.choices)  # no tag leaks
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_a_second_turn_carries_the_tool_result(qwen_stack: Stack) -> None:
    client = qwen_stack.client()
    first = client.chat.completions.create(
        model=TRAINED, messages=TOOL_CALL_MESSAGES, tools=TOOL_CALL_TOOLS, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *TOOL_CALL_MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "clear"})},
    ]
    second = client.chat.completions.create(model=TRAINED, messages=history, tools=TOOL_CALL_TOOLS, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("model", [RANDOM, CODER])
def test_a_named_function_is_forced_by_constrained_decoding(qwen_stack: Stack, model: str) -> None:
    reply = qwen_stack.client().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "find shoes"}],
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "function", "function": {"name": "search_products"}},
        max_tokens=300,
        seed=3,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "search_products"
    jsonschema.validate(json.loads(call.function.arguments), SEARCH["function"]["parameters"])


def test_tool_choice_required_gives_a_call_to_an_offered_tool(qwen_stack: Stack) -> None:
    reply = qwen_stack.client().chat.completions.create(
        model=RANDOM, messages=[{"role": "user", "content": "x"}], tools=[WEATHER, SEARCH],
        tool_choice="required", parallel_tool_calls=False, max_tokens=300, seed=5,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "search_products")
    schema = {tool["function"]["name"]: tool["function"]["parameters"] for tool in [WEATHER, SEARCH]}
    jsonschema.validate(json.loads(calls[0].function.arguments), schema[calls[0].function.name])


def test_json_schema_response_format_is_followed_by_a_random_model(qwen_stack: Stack) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    }
    reply = qwen_stack.client().chat.completions.create(
        model=RANDOM, messages=[{"role": "user", "content": "a person"}], max_tokens=300, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    # Any JSON object: the random model would open keys forever, so a bias picks the "{}" token.
    (empty_object,) = AutoTokenizer.from_pretrained(tiny_random_qwen3_dir("qwen3")).encode("{}")
    anything = qwen_stack.client().chat.completions.create(
        model=RANDOM, messages=[{"role": "user", "content": "x"}], max_tokens=50, seed=2,
        response_format={"type": "json_object"}, logit_bias={str(empty_object): 100},
    )  # fmt: skip
    assert json.loads(anything.choices[0].message.content) == {}


def test_a_schema_without_a_finite_value_is_a_400_not_an_empty_reply(qwen_stack: Stack) -> None:
    forever = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    with pytest.raises(openai.BadRequestError) as raised:
        qwen_stack.client().chat.completions.create(
            model=RANDOM, messages=[{"role": "user", "content": "x"}], max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": forever, "strict": True}},
        )  # fmt: skip
    assert raised.value.body["param"] == "response_format"  # type: ignore[index]
    assert "no finite value" in raised.value.body["message"]  # type: ignore[index]


def test_reasoning_goes_to_its_own_field(qwen_stack: Stack) -> None:
    think_token = "151667"  # <think>: the random model is pushed to open a thinking block
    reply = qwen_stack.client().chat.completions.create(
        model=RANDOM, messages=[{"role": "user", "content": "x"}], max_tokens=6, logit_bias={think_token: 100}
    )
    message = reply.choices[0].message
    assert "<think>" not in (message.content or "")
    assert getattr(message, "reasoning_content", None) is not None


def test_constrained_requests_refuse_settings_that_fight_the_grammar(qwen_stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        qwen_stack.client().chat.completions.create(
            model=RANDOM, messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    assert raised.value.body["param"] == "ignore_eos"
    with pytest.raises(openai.BadRequestError) as named:
        qwen_stack.client().chat.completions.create(
            model=RANDOM, messages=[{"role": "user", "content": "x"}], tools=TOOL_CALL_TOOLS,
            tool_choice={"type": "function", "function": {"name": "not_offered"}},
        )  # fmt: skip
    assert named.value.body["param"] == "tool_choice"


def test_a_template_without_tools_refuses_them_clearly(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOL_CALL_TOOLS
        )
    assert raised.value.body["param"] == "tools" and "tool support" in raised.value.message
    plain = client.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": "x"}],
        tools=TOOL_CALL_TOOLS,
        tool_choice="none",
        max_tokens=2,
    )
    assert plain.choices[0].message.tool_calls is None
