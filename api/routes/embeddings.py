"""``POST /v1/embeddings``: served by embedding workers, through the same queue as generation."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api.jobs.stream import ClientDisconnected
from api.render.embeddings import collect_embeddings
from api.routes.chat import CLIENT_CLOSED_REQUEST, ERROR_RESPONSES
from api.routes.start import job_of, start_stream
from api.wire.openai.embeddings import EmbeddingRequest, EmbeddingResponse

router = APIRouter()


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=ERROR_RESPONSES,
    summary="Create embeddings (OpenAI-compatible)",
)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response | EmbeddingResponse:
    stream = await start_stream(request, job_of(request, body))
    if stream is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        return await collect_embeddings(stream, body.encoding_format)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
