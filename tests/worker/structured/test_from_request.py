"""OpenAI request fields → constraints, and the 400s for forced calls that cannot be honoured."""

from __future__ import annotations

from typing import Any

import pytest

from api.jobs.build import chat_generate
from api.wire.openai.chat_request import ChatCompletionRequest
from shared.contract import Generate
from shared.errors import ErrorKind, RelayError
from worker.structured import (
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ToolCallConstraint,
    ToolSchema,
    constraint_from_request,
)
from worker.structured.constraints import NO_PARAMETERS

SEARCH_PARAMETERS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": SEARCH_PARAMETERS, "strict": True}},
    {"type": "function", "function": {"name": "now"}},
]


def request(**fields: Any) -> Generate:
    return chat_generate(
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    )


def test_free_text_has_no_constraint() -> None:
    assert constraint_from_request(request(), "hermes") is None
    assert constraint_from_request(request(response_format={"type": "text"}), "hermes") is None
    assert constraint_from_request(request(tools=TOOLS, tool_choice="auto"), "hermes") is None


def test_response_formats() -> None:
    assert constraint_from_request(request(response_format={"type": "json_object"}), None) == JsonObjectConstraint()
    json_schema = {"name": "answer", "schema": SEARCH_PARAMETERS, "strict": True}
    constraint = constraint_from_request(
        request(response_format={"type": "json_schema", "json_schema": json_schema}), None
    )
    assert constraint == JsonSchemaConstraint(SEARCH_PARAMETERS, is_strict=True)
    without_schema = {"type": "json_schema", "json_schema": {"name": "answer"}}
    assert constraint_from_request(request(response_format=without_schema), None) == JsonObjectConstraint()


def test_json_schema_format_needs_its_json_schema_object() -> None:
    with pytest.raises(RelayError) as raised:
        constraint_from_request(request(response_format={"type": "json_schema"}), None)
    assert raised.value.param == "response_format"


def test_required_tool_choice_forces_any_tool_in_the_model_format() -> None:
    constraint = constraint_from_request(request(tools=TOOLS, tool_choice="required"), "qwen3_coder")
    assert constraint == ToolCallConstraint(
        format="qwen3_coder",
        tools=(ToolSchema("search", SEARCH_PARAMETERS, is_strict=True), ToolSchema("now", NO_PARAMETERS)),
        is_parallel=True,
    )


def test_named_tool_choice_forces_that_tool_and_wins_over_response_format() -> None:
    named = {"type": "function", "function": {"name": "now"}}
    forced = request(tools=TOOLS, tool_choice=named, parallel_tool_calls=False, response_format={"type": "json_object"})
    constraint = constraint_from_request(forced, "hermes")
    assert constraint == ToolCallConstraint("hermes", (ToolSchema("now", NO_PARAMETERS),), is_parallel=False)


@pytest.mark.parametrize(
    ("fields", "tool_call_format"),
    [
        ({"tool_choice": "required"}, "hermes"),
        ({"tools": TOOLS, "tool_choice": "required"}, None),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "hermes"),
    ],
    ids=["no_tools", "model_without_format", "unknown_name"],
)
def test_forced_calls_that_cannot_be_honoured_are_400s(fields: dict[str, Any], tool_call_format: Any) -> None:
    with pytest.raises(RelayError) as raised:
        constraint_from_request(request(**fields), tool_call_format)
    assert (raised.value.kind, raised.value.param) == (ErrorKind.INVALID_REQUEST, "tool_choice")
