"""``POST /v1/messages``: the Anthropic Messages API, on the same jobs as chat completions.

The request becomes a chat request (``api/wire/anthropic.py``) and runs as a chat job:
queueing, failover, tool parsing, constrained tool choice and keep-alives are the chat path's.
Errors on these routes are in Anthropic's shape (``api/errors.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from api.errors import translation_error
from api.jobs.build import chat_generate
from api.render.anthropic import collect_message, message_events
from api.routes.chat import OpenApiResponses
from api.routes.start import answer, chat_job, check_request_limits
from api.routes.tokenize import run_tokenize
from api.services import services_of
from api.tenancy import tenant_of
from api.wire.anthropic import (
    AnthropicErrorResponse,
    CountTokensRequest,
    MessagesRequest,
    image_sources,
    to_chat_request,
)
from api.wire.openai.chat_request import ChatCompletionRequest
from shared.contract import Tokenize

router = APIRouter()
_ERRORS: OpenApiResponses = {
    status: {"model": AnthropicErrorResponse} for status in (400, 401, 404, 413, 429, 500, 502, 503, 504)
}


def chat_request_of(body: CountTokensRequest) -> ChatCompletionRequest:
    """400 (naming the field) for what the chat path cannot take."""
    try:
        return to_chat_request(body)
    except ValueError as exc:
        raise translation_error(exc, "messages") from None


class TokenCount(BaseModel):
    input_tokens: int


@router.post(
    "/v1/messages/count_tokens", response_model=TokenCount, responses=_ERRORS, summary="Count a message's input tokens"
)
async def count_message_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    """The prompt a worker would render for the same request (system, messages, tools), counted
    by that worker's tokenizer: equal to the ``usage.input_tokens`` the request reports."""
    services = services_of(request)
    chat = chat_request_of(body)
    check_request_limits(chat, services.settings)
    images = await services.images.load(tenant_of(request), chat.model, image_sources(body))
    tokenize = Tokenize(model=chat.model, chat=chat_generate(chat, images=images.refs))
    token_ids, _ = await run_tokenize(request, tokenize, images)
    return TokenCount(input_tokens=len(token_ids))


@router.post(
    "/v1/messages",
    responses={200: {"content": {"application/json": {}, "text/event-stream": {}}}, **_ERRORS},
    summary="Create a message (Anthropic Messages API; SSE when stream=true)",
)
async def create_message(body: MessagesRequest, request: Request) -> Any:
    job, images = await chat_job(request, chat_request_of(body), image_sources(body))
    return await answer(request, job, collect_message, message_events, images)
