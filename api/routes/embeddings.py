"""``POST /v1/embeddings``: served by embedding workers, through the same queue as generation."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api.render.embeddings import collect_embeddings
from api.routes.chat import ERROR_RESPONSES
from api.routes.start import answer, job_of
from api.wire.openai.embeddings import EmbeddingRequest, EmbeddingResponse

router = APIRouter()


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=ERROR_RESPONSES,
    summary="Create embeddings (OpenAI-compatible)",
)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response | EmbeddingResponse:
    return await answer(request, job_of(request, body), lambda stream: collect_embeddings(stream, body.encoding_format))
