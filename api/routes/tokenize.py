"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's request and response shapes): a model's own
tokenizer and chat template, run by one of its workers (the API process loads no tokenizer)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, NonNegativeInt, model_validator

from api.jobs.build import chat_generate, tokenize_job
from api.jobs.images import NO_IMAGES, JobImages
from api.jobs.stream import ClientDisconnected
from api.render.accumulator import JobResult, collect
from api.routes.chat import ERROR_RESPONSES
from api.services import services_of
from api.tenancy import tenant_of
from api.wire.openai.chat_request import ChatCompletionRequest, ChatMessage, ToolDefinition, image_sources
from shared.contract import Tokenize
from shared.errors import ErrorKind, RelayError

router = APIRouter()


class TokenizeBody(BaseModel):
    """A ``prompt`` (tokenized as it is) or chat ``messages`` (rendered by the chat template, as a
    chat request would be: the count equals that request's prompt tokens)."""

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = Field(
        default=None, description="For a prompt (default true); chat templates place their own special tokens."
    )

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either `prompt` or `messages`")
        if self.messages is not None and not self.add_generation_prompt:
            raise ValueError("add_generation_prompt=false is not supported: prompts are rendered as chat requests are")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeBody(BaseModel):
    model: str = Field(min_length=1)
    tokens: list[NonNegativeInt]


class DetokenizeResponse(BaseModel):
    prompt: str


async def run_tokenize(request: Request, tokenize: Tokenize, images: JobImages = NO_IMAGES) -> tuple[list[int], str]:
    """The token ids (and, detokenizing, the text) one of the model's workers answers with;
    ``images``: those the chat's messages name, loaded."""
    state = request.state
    job = tokenize_job(tokenize, state.request_id, state.request_id_is_ours, tenant_of(request).owner)
    stream = await services_of(request).jobs.stream(job, request.is_disconnected, images=images.data)
    try:
        result = await collect(stream, JobResult())
    except ClientDisconnected:
        raise RelayError(ErrorKind.CANCELLED, "The client closed the request.") from None
    if result.usage is None:
        raise RelayError(ErrorKind.INTERNAL, "The worker ended the job without an answer.")
    answer = result.choices[0]  # the worker answers in one delta
    return answer.token_ids, answer.content


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES, summary="Tokenize (vLLM)")
async def tokenize(body: TokenizeBody, request: Request) -> TokenizeResponse:
    if body.messages is not None:
        chat = ChatCompletionRequest(
            model=body.model, messages=body.messages, tools=body.tools, chat_template_kwargs=body.chat_template_kwargs
        )
        images = await services_of(request).images.load(tenant_of(request), body.model, image_sources(chat))
        tokenize_request = Tokenize(model=body.model, chat=chat_generate(chat, images=images.refs))
    else:
        images = NO_IMAGES
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokenize_request = Tokenize(model=body.model, prompt=body.prompt, add_special_tokens=add_special)
    token_ids, _ = await run_tokenize(request, tokenize_request, images)
    directory = services_of(request).directory
    limits = {record.model: record.max_model_len for record in await directory.model_records()}
    adapter = await directory.adapter_of(body.model)  # an adapter's context is its base model's
    model = body.model if adapter is None else adapter.base
    return TokenizeResponse(count=len(token_ids), max_model_len=limits.get(model, 0), tokens=token_ids)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES, summary="Detokenize (vLLM)")
async def detokenize(body: DetokenizeBody, request: Request) -> DetokenizeResponse:
    _, text = await run_tokenize(request, Tokenize(model=body.model, tokens=body.tokens))
    return DetokenizeResponse(prompt=text)
