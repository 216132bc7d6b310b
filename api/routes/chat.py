"""``POST /v1/chat/completions``: stream and non-stream go through the same job path."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api.jobs.background import submit_background
from api.jobs.images import NO_IMAGES, JobImages
from api.jobs.stream import ClientDisconnected, JobStream
from api.jobs.submitter import JobSubmitter, SubmittableRequest
from api.render.chat import collect_completion
from api.render.chat_stream import sse_chunks, sse_response
from api.services import services_of
from api.settings import ApiSettings
from api.tenancy import tenant_of
from api.wire.openai.chat_request import ChatCompletionRequest, image_sources
from api.wire.openai.chat_response import ChatCompletion
from api.wire.openai.errors import ErrorResponse
from shared.errors import ErrorKind, RelayError
from shared.events import ErrorEvent

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


def check_request_limits(body: ChatCompletionRequest, settings: ApiSettings) -> None:
    if len(body.messages) > settings.max_messages:
        message = f"At most {settings.max_messages} messages are allowed."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "messages")
    if body.tools and len(body.tools) > settings.max_tools:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"At most {settings.max_tools} tools are allowed.", "tools")


async def start_stream(
    submitter: JobSubmitter, body: SubmittableRequest, request: Request, images: JobImages = NO_IMAGES
) -> JobStream | None:
    """Submit, then wait for the worker's first word before answering: a rejection (context too
    long, bad template input) can still be a proper HTTP error instead of a 200 stream. A stream
    whose job is still queued after one keep-alive period starts anyway, so that keep-alive
    comments flow while it waits (proxies cut silent connections); a rejection then arrives as
    an error event. None: the client left while waiting. ``images``: the request's, loaded."""
    state = request.state
    tenant = tenant_of(request).owner
    stream = await submitter.submit(
        body, state.request_id, request.is_disconnected, state.request_id_is_ours, tenant, images
    )
    wait_s = submitter.settings.sse_ping_interval_s if body.stream else None
    try:
        first = await stream.first_event(wait_s)
    except ClientDisconnected:
        await stream.close()
        return None
    except BaseException:
        await stream.close()
        raise
    if isinstance(first, ErrorEvent):
        await stream.close()
        raise first.to_exception()
    if body.stream:
        stream.stop_disconnect_probe()  # sse-starlette owns the connection from here
    return stream


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses=with_errors(200, "text/event-stream"),
    summary="Create a chat completion (OpenAI-compatible; SSE when stream=true)",
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    submitter = services_of(request).submitter
    check_request_limits(body, submitter.settings)
    images = await services_of(request).images.load(tenant_of(request), body.model, image_sources(body))
    if body.background:
        return JSONResponse(await submit_background(submitter, body, request, images))
    stream = await start_stream(submitter, body, request, images)
    if stream is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    reasoning_field = submitter.settings.reasoning_field
    if body.stream:
        return sse_response(sse_chunks(stream, body.include_usage, reasoning_field), submitter.settings)
    try:
        return await collect_completion(stream, reasoning_field)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
