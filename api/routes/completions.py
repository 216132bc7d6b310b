"""``POST /v1/completions``: text completions through the same queue, workers and batching as chat."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api.jobs.stream import ClientDisconnected
from api.render.chat_stream import sse_response
from api.render.completion import collect_text_completion, sse_completion_chunks
from api.routes.chat import CLIENT_CLOSED_REQUEST, with_errors
from api.routes.start import job_of, start_stream
from api.services import services_of
from api.wire.openai.completion_request import CompletionRequest
from api.wire.openai.completion_response import Completion

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses=with_errors(200, "text/event-stream"),
    summary="Create a text completion (OpenAI-compatible; SSE when stream=true)",
)
async def create_completion(body: CompletionRequest, request: Request) -> Response | Completion:
    stream = await start_stream(request, job_of(request, body))
    if stream is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if body.stream:
        return sse_response(sse_completion_chunks(stream, body.include_usage), services_of(request).settings)
    try:
        return await collect_text_completion(stream)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
