"""A generation request → the constraint its output must satisfy, or None when it is free.

A forced tool call (``tool_choice`` ``required`` or a named function) takes precedence over the
output format: the output is then the call itself, not content. The request was checked at the
edge (a forced choice has its tools); what is left to check is what this model can do.
"""

from __future__ import annotations

from shared.contract import Generate, OutputFormat, Tool
from shared.errors import ErrorKind, RelayError
from worker.structured.constraints import (
    NO_PARAMETERS,
    Constraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ToolCallConstraint,
    ToolCallFormat,
    ToolSchema,
)


def constraint_from_request(request: Generate, tool_call_format: ToolCallFormat | None) -> Constraint | None:
    """``tool_call_format``: the served model's native tool-call format, None if it has none.

    Raises ``RelayError(INVALID_REQUEST)`` for a forced call this model cannot make.
    """
    if request.tool_choice in ("required", "function"):
        return _tool_call_constraint(request, tool_call_format)
    return _output_constraint(request.output)


def _tool_call_constraint(request: Generate, tool_call_format: ToolCallFormat | None) -> Constraint:
    if tool_call_format is None:
        message = "this model has no tool-call format, so a tool call cannot be forced"
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "tool_choice")
    is_named = request.tool_choice == "function"
    tools = [tool for tool in request.tools if tool.name == request.tool_name] if is_named else request.tools
    # A named function means exactly that call, as in OpenAI's API; "required" may call several.
    return ToolCallConstraint(
        format=tool_call_format,
        tools=tuple(_tool_schema(tool) for tool in tools),
        is_parallel=request.parallel_tool_calls and not is_named,
    )


def _tool_schema(tool: Tool) -> ToolSchema:
    parameters = tool.parameters if tool.parameters is not None else NO_PARAMETERS
    return ToolSchema(name=tool.name, parameters=parameters, is_strict=bool(tool.strict))


def _output_constraint(output: OutputFormat | None) -> Constraint | None:
    if output is None:
        return None
    if output.type == "json_object" or output.json_schema is None:
        # OpenAI makes the schema optional; without one the only promise left is a JSON object.
        return JsonObjectConstraint()
    return JsonSchemaConstraint(schema=output.json_schema, is_strict=output.strict)
