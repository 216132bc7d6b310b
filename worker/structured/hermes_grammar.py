"""Forced tool calls in the hermes format Qwen3 is trained on.

One call is ``<tool_call>\\n{"name": "<name>", "arguments": <JSON>}\\n</tool_call>``; parallel
calls follow one another separated by ``\\n``. The envelope is literal text with the spacing of
the chat template's examples, so only the arguments are the model's choice.
"""

from __future__ import annotations

import json

from worker.structured.constraints import ToolSchema
from worker.structured.lark_text import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TagTokens, embedded_json, literal


def hermes_grammar(tools: tuple[ToolSchema, ...], is_parallel: bool, tags: TagTokens) -> str:
    repeat = ' ("\\n" tool_call)*' if is_parallel else ""
    calls = " | ".join(f"call_{index}" for index in range(len(tools)))
    open_tag, close_tag = tags.render(TOOL_CALL_OPEN), tags.render(TOOL_CALL_CLOSE)
    lines = [f"start: tool_call{repeat}", f'tool_call: {open_tag} "\\n" ({calls}) "\\n" {close_tag}']
    for index, tool in enumerate(tools):
        lines += _call_rules(index, tool)
    return "\n".join(lines) + "\n"


def _call_rules(index: int, tool: ToolSchema) -> list[str]:
    envelope = '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
    return [
        f'call_{index}: {literal(envelope)} arguments_{index} "}}"',
        f"arguments_{index}: {embedded_json(tool.parameters, tool.is_strict)}",
    ]
