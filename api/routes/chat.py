"""``POST /v1/chat/completions``: stream and non-stream go through the same job path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api.render.background import background_summary
from api.render.chat import collect_completion
from api.render.chat_stream import sse_chunks
from api.routes.start import answer, chat_job
from api.services import services_of
from api.wire.openai.chat_request import ChatCompletionRequest, image_sources
from api.wire.openai.chat_response import ChatCompletion
from api.wire.openai.errors import ErrorResponse

router = APIRouter()
Route = TypeVar("Route", bound=Callable[..., Any])

# FastAPI's `responses` type: status → OpenAPI response fields.
OpenApiResponses = dict[int | str, dict[str, Any]]
ERROR_RESPONSES: OpenApiResponses = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 502, 503)
}


def with_errors(status: int, media_type: str) -> OpenApiResponses:
    """The error responses plus a success answer of another media type (a stream, a file)."""
    return {status: {"content": {media_type: {}}}, **ERROR_RESPONSES}


def streaming_post(on: APIRouter, path: str, summary: str, response_model: Any = None) -> Callable[[Route], Route]:
    """A POST route answered with ``response_model`` as JSON, or as server-sent events when the
    request says ``stream``."""
    return on.post(
        path, response_model=response_model, responses=with_errors(200, "text/event-stream"), summary=summary
    )


@streaming_post(
    router, "/v1/chat/completions", "Create a chat completion (OpenAI-compatible; SSE when stream=true)", ChatCompletion
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    job, images = await chat_job(request, body, image_sources(body))
    if body.background:
        await services_of(request).jobs.detach(job, images.data)
        return JSONResponse(background_summary(job, "queued"))
    reasoning_field = services_of(request).settings.reasoning_field
    return await answer(
        request,
        job,
        lambda stream: collect_completion(stream, reasoning_field),
        lambda stream: sse_chunks(stream, body.include_usage, reasoning_field),
        images,
    )
