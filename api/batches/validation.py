"""Checking a batch input file line by line, as OpenAI does: every problem is reported with its
line number, and a file with any problem fails as a whole before a single line runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ValidationError

from api.errors import validation_message
from api.middleware import lone_surrogate_path
from api.wire.openai.batch import BatchError, BatchInputLine
from api.wire.openai.chat_request import ChatCompletionRequest, image_sources
from api.wire.openai.completion_request import CompletionRequest
from api.wire.openai.embeddings import EmbeddingRequest

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}
# Beyond this many, further problems are counted, not listed.
MAX_REPORTED_ERRORS = 100


@dataclass
class ValidatedFile:
    lines: dict[int, BatchInputLine] = field(default_factory=dict)  # 1-based line number → line
    errors: list[BatchError] = field(default_factory=list)
    model: str | None = None


def validate_batch_file(
    content: bytes, endpoint: str, max_requests: int, is_known_model: Callable[[str], bool]
) -> ValidatedFile:
    """Parse and check each line; ``is_known_model`` says whether this deployment serves a model."""
    result = ValidatedFile()
    seen_custom_ids: set[str] = set()
    request_model = REQUEST_MODELS[endpoint]

    def report(line: int | None, code: str, message: str, param: str | None = None) -> None:
        result.errors.append(BatchError(code=code, message=message, line=line, param=param))

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        report(None, "invalid_file", f"The file is not UTF-8 text (byte {exc.start}).")
        return result
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        line = _parse_line(raw, number, report)
        if line is None:
            continue
        if line.custom_id in seen_custom_ids:
            report(number, "duplicate_custom_id", f"custom_id `{line.custom_id}` appears more than once.", "custom_id")
            continue
        seen_custom_ids.add(line.custom_id)
        if line.url != endpoint:
            report(number, "mismatched_url", f"The line's url `{line.url}` is not the batch's `{endpoint}`.", "url")
            continue
        if line.body.get("stream"):
            report(number, "stream_unsupported", "Batch requests cannot stream (`stream: true`).", "body.stream")
            continue
        if line.body.get("background"):
            report(number, "invalid_request", "Batch requests cannot be background jobs.", "body.background")
            continue
        try:
            request = request_model.model_validate(line.body)
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            report(number, "invalid_request", message, f"body.{param}" if param else "body")
            continue
        if isinstance(request, ChatCompletionRequest) and (images := image_sources(request)):
            # A line runs long after the file was checked: its images would be fetched then, unchecked now.
            report(number, "invalid_request", "Batch requests cannot hold images.", f"body.{images[0].param}")
            continue
        model = str(request.model)  # type: ignore[attr-defined]
        if not is_known_model(model):
            report(number, "model_not_found", f"The model `{model}` is not served here.", "body.model")
            continue
        if result.model is None:
            result.model = model
        elif model != result.model:
            message = f"Every line must use one model; this one uses `{model}`, earlier ones `{result.model}`."
            report(number, "mixed_models", message, "body.model")
            continue
        result.lines[number] = line
    if not result.lines and not result.errors:
        report(None, "empty_file", "The input file holds no requests.")
    if len(result.lines) > max_requests:
        report(None, "too_many_requests", f"A batch holds at most {max_requests} requests.")
    return result


def _parse_line(raw: str, number: int, report: Callable[..., None]) -> BatchInputLine | None:
    try:
        document = json.loads(raw)
    except ValueError as exc:
        report(number, "invalid_json_line", f"The line is not valid JSON: {exc}.")
        return None
    surrogate_at = lone_surrogate_path(document, [])
    if surrogate_at is not None:
        # Legal JSON text, but not Unicode: it could never be stored or sent on as UTF-8.
        report(number, "invalid_request", "Text contains a lone UTF-16 surrogate.", ".".join(surrogate_at) or None)
        return None
    try:
        return BatchInputLine.model_validate(document)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        report(number, "invalid_request", message, param)
        return None
