"""Which tool and reasoning parsers a worker uses, and what each request gets from them.

At start-up the parsers are chosen from the chat template (overridable by flags): a template
that writes ``<function=`` inside ``<tool_call>`` is Qwen3-Coder's XML format, one with
``<tool_call>`` alone is hermes JSON, one with ``<think>`` gets the qwen3 reasoning parser. Per
request: ``tool_choice: "none"`` hides the tools from the template and parses no calls;
``parallel_tool_calls: false`` ends the choice at the first ``</tool_call>``; a template without
tool support refuses tools with a 400 unless the generic tool prompt is switched on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.contract import Generate, Tool
from shared.errors import ErrorKind, RelayError
from worker.parsers import base as parser_registry
from worker.parsers.pipeline import TextPipeline

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

AUTO = "auto"
NONE = "none"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"

# The hermes instructions Qwen's own templates write, for templates that have no tool support.
_GENERIC_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolingConfig:
    tool_parser: str | None
    reasoning_parser: str | None
    template_supports_tools: bool
    generic_tool_prompt: bool


def _detect_tool_parser(template: str) -> str | None:
    if "<tool_call>" not in template:
        return None
    return "qwen3_coder" if "<function=" in template else "hermes"


def resolve_tooling(
    tokenizer: PreTrainedTokenizerBase, tool_parser: str, reasoning_parser: str, generic_tool_prompt: bool
) -> ToolingConfig:
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    chosen_tools = _detect_tool_parser(template) if tool_parser == AUTO else tool_parser
    if generic_tool_prompt and chosen_tools is None and tool_parser == AUTO:
        chosen_tools = "hermes"
    chosen_reasoning = ("qwen3" if THINK_START in template else None) if reasoning_parser == AUTO else reasoning_parser
    config = ToolingConfig(
        tool_parser=None if chosen_tools == NONE else chosen_tools,
        reasoning_parser=None if chosen_reasoning == NONE else chosen_reasoning,
        template_supports_tools="tools" in template,
        generic_tool_prompt=generic_tool_prompt,
    )
    for name, lookup in ((config.tool_parser, parser_registry.tool_parser_class),
                         (config.reasoning_parser, parser_registry.reasoning_parser_class)):  # fmt: skip
        if name is not None:
            lookup(name)  # fail at start-up on an unknown name
    return config


@dataclass(frozen=True)
class RequestTooling:
    """What one request needs: tools for the template, an extra system prompt, stop strings,
    and how to build each choice's text pipeline once the prompt text is known."""

    template_tools: list[dict[str, Any]] | None
    system_prompt: str | None
    stop_strings: tuple[str, ...]
    make_pipeline: Callable[[str], TextPipeline] | None


def template_tool(tool: Tool) -> dict[str, Any]:
    """A tool as chat templates and parsers know it: OpenAI's function tool, without empty fields."""
    return {"type": "function", "function": tool.model_dump(exclude_none=True)}


def plan_tooling(config: ToolingConfig, request: Generate) -> RequestTooling:
    tools = [template_tool(tool) for tool in request.tools]
    wants_tools = bool(tools) and request.tool_choice != "none"
    if wants_tools:
        _check_tools_supported(config, request)
    thinking = request.chat_template_kwargs.get("enable_thinking", True) is not False
    reasoning_name = config.reasoning_parser if thinking else None
    tool_name = config.tool_parser if wants_tools else None
    make_pipeline = None
    if reasoning_name or tool_name:

        def make_pipeline(prompt_text: str) -> TextPipeline:
            reasoning = None
            if reasoning_name is not None:
                starts_in_reasoning = prompt_text.rstrip().endswith(THINK_START)
                reasoning = parser_registry.reasoning_parser_class(reasoning_name)(starts_in_reasoning)
            calls = parser_registry.tool_parser_class(tool_name)(tools) if tool_name is not None else None
            return TextPipeline(reasoning, calls)

    use_generic = wants_tools and not config.template_supports_tools
    return RequestTooling(
        template_tools=tools if wants_tools and not use_generic else None,
        system_prompt=_generic_prompt(tools) if use_generic else None,
        stop_strings=(TOOL_CALL_END,) if wants_tools and not request.parallel_tool_calls else (),
        make_pipeline=make_pipeline,
    )


def _check_tools_supported(config: ToolingConfig, request: Generate) -> None:
    if not config.template_supports_tools and not config.generic_tool_prompt:
        raise RelayError(
            ErrorKind.INVALID_REQUEST,
            f"Model `{request.model}` has a chat template without tool support; send tool_choice 'none', "
            "or start its worker with --generic-tool-prompt.",
            "tools",
        )
    if config.tool_parser is None:
        raise RelayError(
            ErrorKind.INVALID_REQUEST,
            f"No tool-call parser is configured for model `{request.model}` (worker flag --tool-parser).",
            "tools",
        )


def _generic_prompt(tools: list[dict[str, Any]]) -> str:
    return _GENERIC_TOOL_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
