"""``POST /v1/completions``: text completions through the same queue, workers and batching as chat."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api.render.completion import collect_text_completion, sse_completion_chunks
from api.routes.chat import streaming_post
from api.routes.start import answer, job_of
from api.wire.openai.completion_request import CompletionRequest
from api.wire.openai.completion_response import Completion

router = APIRouter()


@streaming_post(
    router, "/v1/completions", "Create a text completion (OpenAI-compatible; SSE when stream=true)", Completion
)
async def create_completion(body: CompletionRequest, request: Request) -> Response | Completion:
    return await answer(
        request,
        job_of(request, body),
        collect_text_completion,
        lambda stream: sse_completion_chunks(stream, body.include_usage),
    )
