"""JSON Schemas that requests carry (a response format's, a tool's parameters), checked against
their metaschema where the request is read: a schema that is not a schema at all needs no model,
so it is a 400 naming its field at once, even while every worker is busy or loading. What only
the grammar compiler can know (a keyword it cannot enforce, a schema no finite value satisfies)
is the worker's to say."""

from __future__ import annotations

from typing import Annotated, Any

from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator
from jsonschema.validators import Draft202012Validator, validator_for
from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

# A refused schema's message quotes the offending value; a huge one is cut here.
MAX_PROBLEM_CHARS = 300


def metaschema_of(schema: dict[str, Any]) -> type[Validator]:
    """The draft ``$schema`` names when it names one jsonschema knows, else Draft 2020-12 (whose
    metaschema then refuses a ``$schema`` that is not a URI string)."""
    if not isinstance(schema.get("$schema", ""), str):
        return Draft202012Validator
    return validator_for(schema, default=Draft202012Validator)


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is not a valid JSON Schema, or None when it is."""
    try:
        metaschema_of(schema).check_schema(schema)
    except SchemaError as error:
        problem = error.message
        if len(problem) > MAX_PROBLEM_CHARS:
            problem = problem[: MAX_PROBLEM_CHARS - 1] + "…"
        return f"not a valid JSON Schema: {problem} (at {error.json_path})"
    return None


def _checked(schema: dict[str, Any]) -> dict[str, Any]:
    problem = schema_problem(schema)
    if problem is not None:
        raise PydanticCustomError("invalid_json_schema", "{problem}", {"problem": problem})
    return schema


JsonSchema = Annotated[dict[str, Any], AfterValidator(_checked)]
"""A JSON object that is a valid JSON Schema (for a wire model's field)."""
