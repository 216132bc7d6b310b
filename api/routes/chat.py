"""``POST /v1/chat/completions``: stream and non-stream go through the same job path."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api.jobs.stream import ClientDisconnected
from api.render.background import background_summary
from api.render.chat import collect_completion
from api.render.chat_stream import sse_chunks, sse_response
from api.routes.start import chat_job, start_stream
from api.services import services_of
from api.wire.openai.chat_request import ChatCompletionRequest, image_sources
from api.wire.openai.chat_response import ChatCompletion
from api.wire.openai.errors import ErrorResponse

router = APIRouter()

CLIENT_CLOSED_REQUEST = 499
# FastAPI's `responses` type: status → OpenAPI response fields.
OpenApiResponses = dict[int | str, dict[str, Any]]
ERROR_RESPONSES: OpenApiResponses = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 502, 503)
}


def with_errors(status: int, media_type: str) -> OpenApiResponses:
    """The error responses plus a success answer of another media type (a stream, a file)."""
    return {status: {"content": {media_type: {}}}, **ERROR_RESPONSES}


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses=with_errors(200, "text/event-stream"),
    summary="Create a chat completion (OpenAI-compatible; SSE when stream=true)",
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    settings = services_of(request).settings
    job, images = await chat_job(request, body, image_sources(body))
    if body.background:
        await services_of(request).jobs.detach(job, images.data)
        return JSONResponse(background_summary(job, "queued"))
    stream = await start_stream(request, job, images)
    if stream is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    reasoning_field = settings.reasoning_field
    if body.stream:
        return sse_response(sse_chunks(stream, body.include_usage, reasoning_field), settings)
    try:
        return await collect_completion(stream, reasoning_field)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
