"""An OpenAI chat request → the constraint its output must satisfy, or None when it is free.

A forced tool call (``tool_choice="required"`` or a named function) takes precedence over
``response_format``: the output is then the call itself, not content.
"""

from __future__ import annotations

from shared.errors import ErrorKind, RelayError
from shared.openai.chat_request import ChatCompletionRequest, NamedToolChoice, ResponseFormat, ToolDefinition
from worker.structured.constraints import (
    NO_PARAMETERS,
    Constraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ToolCallConstraint,
    ToolCallFormat,
    ToolSchema,
)


def constraint_from_request(
    request: ChatCompletionRequest, tool_call_format: ToolCallFormat | None
) -> Constraint | None:
    """``tool_call_format``: the served model's native tool-call format, None if it has none.

    Raises ``RelayError(INVALID_REQUEST)`` for a forced call that cannot be honoured.
    """
    if request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice):
        return _tool_call_constraint(request, tool_call_format)
    return _response_format_constraint(request.response_format)


def _tool_call_constraint(request: ChatCompletionRequest, tool_call_format: ToolCallFormat | None) -> Constraint:
    if not request.tools:
        raise RelayError(ErrorKind.INVALID_REQUEST, "tool_choice requires 'tools' to be set", "tool_choice")
    if tool_call_format is None:
        message = "this model has no tool-call format, so a tool call cannot be forced"
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "tool_choice")
    tools = request.tools
    if isinstance(request.tool_choice, NamedToolChoice):
        tools = [tool for tool in tools if tool.function.name == request.tool_choice.function.name]
        if not tools:
            message = f"tool_choice names {request.tool_choice.function.name!r}, which is not in 'tools'"
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "tool_choice")
    # A named function means exactly that call, as in OpenAI's API; "required" may call several.
    is_named = isinstance(request.tool_choice, NamedToolChoice)
    return ToolCallConstraint(
        format=tool_call_format,
        tools=tuple(_tool_schema(tool) for tool in tools),
        is_parallel=request.parallel_tool_calls and not is_named,
    )


def _tool_schema(tool: ToolDefinition) -> ToolSchema:
    function = tool.function
    parameters = function.parameters if function.parameters is not None else NO_PARAMETERS
    return ToolSchema(name=function.name, parameters=parameters, is_strict=bool(function.strict))


def _response_format_constraint(response_format: ResponseFormat | None) -> Constraint | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return JsonObjectConstraint()
    if response_format.json_schema is None:
        raise RelayError(
            ErrorKind.INVALID_REQUEST, "response_format json_schema requires 'json_schema'", "response_format"
        )
    schema = response_format.json_schema.schema_
    if schema is None:
        # OpenAI makes the schema optional; without one the only promise left is a JSON object.
        return JsonObjectConstraint()
    return JsonSchemaConstraint(schema=schema, is_strict=bool(response_format.json_schema.strict))
