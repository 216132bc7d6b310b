"""Parser choice from the chat template, and what each request gets."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from api.jobs.build import chat_generate
from api.wire.openai.chat_request import ChatCompletionRequest
from shared.contract import Generate
from shared.errors import RelayError
from worker.requests.tooling import ToolingConfig, plan_tooling, resolve_tooling

HERMES_TEMPLATE = "{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>{{ messages }}<think>"
CODER_TEMPLATE = "{% for tool in tools %}{{ tool }}{% endfor %}<tool_call>\n<function={{ name }}>"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _tokenizer(template: str) -> Any:
    return SimpleNamespace(chat_template=template)


def _request(**fields: object) -> Generate:
    return chat_generate(
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    )


@pytest.mark.parametrize(
    ("template", "tool_parser", "reasoning_parser", "supports_tools"),
    [
        (HERMES_TEMPLATE, "hermes", "qwen3", True),
        (CODER_TEMPLATE, "qwen3_coder", None, True),
        (PLAIN_TEMPLATE, None, None, False),
    ],
)
def test_parsers_are_chosen_from_the_template(
    template: str, tool_parser: str | None, reasoning_parser: str | None, supports_tools: bool
) -> None:
    config = resolve_tooling(_tokenizer(template), "auto", "auto", generic_tool_prompt=False)
    assert (config.tool_parser, config.reasoning_parser, config.template_supports_tools) == (
        tool_parser,
        reasoning_parser,
        supports_tools,
    )


def test_flags_override_and_unknown_names_fail_at_start_up() -> None:
    config = resolve_tooling(_tokenizer(HERMES_TEMPLATE), "qwen3_coder", "none", generic_tool_prompt=False)
    assert (config.tool_parser, config.reasoning_parser) == ("qwen3_coder", None)
    with pytest.raises(ValueError, match="unknown tool parser"):
        resolve_tooling(_tokenizer(HERMES_TEMPLATE), "mystery", "auto", generic_tool_prompt=False)


def test_tools_reach_the_template_and_the_parser() -> None:
    config = resolve_tooling(_tokenizer(HERMES_TEMPLATE), "auto", "auto", generic_tool_prompt=False)
    plan = plan_tooling(config, _request(tools=[TOOL]))
    assert plan.template_tools == [TOOL] and plan.system_prompt is None and plan.stop_strings == ()
    assert plan.make_pipeline is not None
    pipeline = plan.make_pipeline("<|im_start|>assistant\n")
    parsed = pipeline.feed(
        '<think>hmm</think>ok<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    parsed.extend(pipeline.finish())
    assert (parsed.reasoning, parsed.content) == ("hmm", "ok")
    assert parsed.tool_calls[0].name == "get_weather" and pipeline.num_tool_calls == 1


def test_tool_choice_none_hides_tools_and_parses_no_calls() -> None:
    config = resolve_tooling(_tokenizer(HERMES_TEMPLATE), "auto", "none", generic_tool_prompt=False)
    plan = plan_tooling(config, _request(tools=[TOOL], tool_choice="none"))
    assert plan.template_tools is None and plan.make_pipeline is None


def test_disabled_thinking_skips_the_reasoning_parser_and_an_open_think_prompt_starts_in_reasoning() -> None:
    config = resolve_tooling(_tokenizer(HERMES_TEMPLATE), "auto", "auto", generic_tool_prompt=False)
    assert plan_tooling(config, _request(chat_template_kwargs={"enable_thinking": False})).make_pipeline is None
    plan = plan_tooling(config, _request())
    assert plan.make_pipeline is not None
    assert plan.make_pipeline("assistant\n<think>\n").feed("still thinking").reasoning == "still thinking"


def test_no_parallel_calls_stops_at_the_first_closing_tag() -> None:
    config = resolve_tooling(_tokenizer(HERMES_TEMPLATE), "auto", "auto", generic_tool_prompt=False)
    assert plan_tooling(config, _request(tools=[TOOL], parallel_tool_calls=False)).stop_strings == ("</tool_call>",)


def test_a_template_without_tools_refuses_them_unless_the_generic_prompt_is_on() -> None:
    plain = resolve_tooling(_tokenizer(PLAIN_TEMPLATE), "auto", "auto", generic_tool_prompt=False)
    with pytest.raises(RelayError) as raised:
        plan_tooling(plain, _request(tools=[TOOL]))
    assert raised.value.status == 400 and raised.value.param == "tools"
    assert plan_tooling(plain, _request(tools=[TOOL], tool_choice="none")).make_pipeline is None
    generic = resolve_tooling(_tokenizer(PLAIN_TEMPLATE), "auto", "auto", generic_tool_prompt=True)
    assert generic == ToolingConfig("hermes", None, False, True)
    plan = plan_tooling(generic, _request(tools=[TOOL]))
    assert plan.template_tools is None and plan.system_prompt is not None and '"get_weather"' in plan.system_prompt
