"""Forced tool calls: every random walk ends in calls a hermes / qwen3_coder parser accepts, to
an allowed function, with arguments that fit its schema."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from api.jobs.build import chat_generate
from api.wire.openai.chat_request import ChatCompletionRequest
from tests.worker.structured.conftest import TokenizerCase, make_case
from tests.worker.structured.random_walk import Walk, random_walk
from worker.structured import ToolCallConstraint, ToolSchema, constraint_from_request

SEEDS = range(4)

WEATHER = ToolSchema(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
FLIGHT = ToolSchema(
    "book_flight",
    {
        "type": "object",
        "properties": {
            "passengers": {
                "type": "array",
                "items": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                "maxItems": 2,
            },
            "budget": {"type": "number"},
            "is_nonstop": {"type": "boolean"},
            "preferences": {"type": "object", "maxProperties": 2},
        },
        "required": ["passengers", "budget", "is_nonstop", "preferences"],
        "additionalProperties": False,
    },
)
CLOCK = ToolSchema("read_clock", {"type": "object", "properties": {}, "additionalProperties": False})
TOOLS = (WEATHER, FLIGHT, CLOCK)
SCHEMAS_BY_NAME = {tool.name: dict(tool.parameters) for tool in TOOLS}

HERMES_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
CODER_CALL = re.compile(r"<tool_call>\n<function=([^>\n]+)>\n(.*?)</function>\n</tool_call>", re.DOTALL)
CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.DOTALL)
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def walk_tool_calls(case: TokenizerCase, constraint: ToolCallConstraint, seed: int) -> Walk:
    compiled = case.compiler.compile_constraint(constraint)
    walk = random_walk(compiled, case.tokenizer, case.vocab_size, seed)
    assert walk.is_terminated, walk.text
    return walk


def split_calls(pattern: re.Pattern[str], text: str) -> list[re.Match[str]]:
    """The calls in ``text``, which must be nothing but calls separated by single newlines."""
    calls = list(pattern.finditer(text))
    assert calls, text
    assert "\n".join(call.group(0) for call in calls) == text
    return calls


def parse_hermes(text: str) -> list[tuple[str, Any]]:
    calls = []
    for match in split_calls(HERMES_CALL, text):
        call = json.loads(match.group(1))
        assert list(call) == ["name", "arguments"]
        calls.append((call["name"], call["arguments"]))
    return calls


def parse_qwen3_coder(text: str) -> list[tuple[str, dict[str, str]]]:
    calls = []
    for match in split_calls(CODER_CALL, text):
        parameters = list(CODER_PARAMETER.finditer(match.group(2)))
        assert "".join(parameter.group(0) for parameter in parameters) == match.group(2)
        calls.append((match.group(1), {parameter.group(1): parameter.group(2) for parameter in parameters}))
    return calls


def check_coder_value(raw: str, schema: dict[str, Any]) -> None:
    """As a qwen3_coder parser converts it: strings stay raw text, other types are JSON."""
    if "enum" in schema:
        assert raw in schema["enum"]
    elif schema["type"] == "string":
        assert "</parameter>" not in raw
    else:
        value = json.loads(raw)
        assert isinstance(value, JSON_TYPES[schema["type"]]), (raw, schema)
        assert schema["type"] == "boolean" or not isinstance(value, bool), raw
        jsonschema.validate(value, schema)


def assert_tags_are_single_tokens(case: TokenizerCase, walk: Walk) -> None:
    tag_ids = case.compiler.tags.token_ids
    if case.name == "qwen_style":
        assert walk.token_ids.count(tag_ids["<tool_call>"]) == walk.text.count("<tool_call>")
    else:
        assert tag_ids == {}


@pytest.mark.parametrize("seed", SEEDS)
def test_hermes_parallel_calls_name_a_tool_and_fit_its_schema(tokenizer_case: TokenizerCase, seed: int) -> None:
    walk = walk_tool_calls(tokenizer_case, ToolCallConstraint("hermes", TOOLS, is_parallel=True), seed)
    for name, arguments in parse_hermes(walk.text):
        jsonschema.validate(arguments, SCHEMAS_BY_NAME[name])
    assert_tags_are_single_tokens(tokenizer_case, walk)


@pytest.mark.parametrize("seed", SEEDS)
def test_hermes_without_parallel_calls_makes_exactly_one(smollm2_case: TokenizerCase, seed: int) -> None:
    walk = walk_tool_calls(smollm2_case, ToolCallConstraint("hermes", TOOLS, is_parallel=False), seed)
    assert len(parse_hermes(walk.text)) == 1


@pytest.mark.parametrize("tool_call_format", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("seed", SEEDS)
def test_named_function_is_the_only_one_called(tokenizer_case: TokenizerCase, tool_call_format: str, seed: int) -> None:
    request = chat_generate(
        ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "book it"}],
                "tools": [
                    {"type": "function", "function": {"name": tool.name, "parameters": tool.parameters}}
                    for tool in TOOLS
                ],
                "tool_choice": {"type": "function", "function": {"name": "book_flight"}},
                "parallel_tool_calls": False,
            }
        )
    )
    constraint = constraint_from_request(request, tool_call_format)  # type: ignore[arg-type]
    assert isinstance(constraint, ToolCallConstraint)
    assert not constraint.is_parallel
    walk = walk_tool_calls(tokenizer_case, constraint, seed)
    parse = parse_hermes if tool_call_format == "hermes" else parse_qwen3_coder
    assert [name for name, _ in parse(walk.text)] == ["book_flight"]


@pytest.mark.parametrize("seed", SEEDS)
def test_qwen3_coder_calls_have_required_parameters_of_their_types(tokenizer_case: TokenizerCase, seed: int) -> None:
    walk = walk_tool_calls(tokenizer_case, ToolCallConstraint("qwen3_coder", TOOLS, is_parallel=True), seed)
    for name, raw_values in parse_qwen3_coder(walk.text):
        schema = SCHEMAS_BY_NAME[name]
        assert set(schema.get("required", [])) <= set(raw_values) <= set(schema["properties"])
        for parameter, raw in raw_values.items():
            check_coder_value(raw, schema["properties"][parameter])
    assert_tags_are_single_tokens(tokenizer_case, walk)


def test_qwen3_coder_free_text_may_span_lines_and_markup(smollm2_case: TokenizerCase) -> None:
    """A string value is raw text: newlines and most markup are fine, only the closing tag is not."""
    compiled = smollm2_case.compiler.compile_constraint(ToolCallConstraint("qwen3_coder", (WEATHER,)))
    matcher = compiled.new_matcher()
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\n<b>York</b> </param\n</parameter>\n"
    tokens = smollm2_case.tokenizer.encode(text, add_special_tokens=False)
    assert all(matcher.accept_token(token) for token in tokens)
    assert not compiled.new_matcher().accept_token(smollm2_case.stop_token_id)


def test_some_walk_makes_parallel_calls(smollm2_case: TokenizerCase) -> None:
    constraint = ToolCallConstraint("qwen3_coder", (CLOCK,), is_parallel=True)
    counts = [len(parse_qwen3_coder(walk_tool_calls(smollm2_case, constraint, seed).text)) for seed in range(6)]
    assert max(counts) > 1, counts


def test_tags_added_as_special_tokens_work_too(default_model_path: Path) -> None:
    """Some tokenizers mark ``<tool_call>`` special; it is still produced as its single token."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    tokenizer.add_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    case = make_case("special_tags", tokenizer)
    walk = walk_tool_calls(case, ToolCallConstraint("hermes", (WEATHER,), is_parallel=False), seed=0)
    [(name, arguments)] = parse_hermes(walk.text)
    jsonschema.validate(arguments, SCHEMAS_BY_NAME[name])
    assert walk.token_ids[0] == tokenizer.convert_tokens_to_ids("<tool_call>")
