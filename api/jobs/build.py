"""Wire requests → contract jobs: every entry point (chat, completions, Responses, Messages,
embeddings, tokenize, batch lines, background jobs) builds its job here, so the same content
becomes the same engine request whichever protocol it came in.

Everything that can be checked without the model's tokenizer is checked here and answered at
once as a 400 naming the field; what needs the tokenizer or the worker's configuration (context
room, vocabulary range, the chat template, tool support, the grammar) is checked by the worker.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from api.jobs.images import NO_IMAGES, JobImages
from api.tenancy import SINGLE_USER, Tenant
from api.wire.openai.chat_request import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    MessageContent,
    NamedToolChoice,
    SystemMessage,
    TextContentPart,
    ToolDefinition,
    ToolMessage,
    UserContentPart,
    UserMessageContent,
)
from api.wire.openai.completion_request import CompletionRequest
from api.wire.openai.embeddings import EmbeddingRequest
from api.wire.openai.images import ImageLocator
from api.wire.openai.sampling_fields import SamplingFields
from shared.contract import (
    AnyJob,
    ChatJob,
    CompletionJob,
    Delivery,
    Embed,
    EmbeddingJob,
    Generate,
    ImagePart,
    ImageRef,
    Message,
    OutputFormat,
    Part,
    Sampling,
    TextPart,
    Tokenize,
    TokenizeJob,
    Tool,
    ToolCall,
    ToolChoice,
)
from shared.errors import ErrorKind, RelayError

SubmittableRequest = ChatCompletionRequest | CompletionRequest | EmbeddingRequest
INTERACTIVE, BATCH = 0, 1


def job_id_for(prefix: str, request_id: str, is_ours: bool) -> str:
    """The response id carries the request id; a client's id gets a suffix, since clients may reuse ids."""
    return f"{prefix}-{request_id}" if is_ours else f"{prefix}-{request_id}-{uuid.uuid4().hex[:8]}"


def make_job(
    request: SubmittableRequest,
    request_id: str,
    is_ours: bool,
    tenant: Tenant = SINGLE_USER,
    priority: int = INTERACTIVE,
    images: JobImages = NO_IMAGES,
) -> AnyJob:
    """``tenant``: the API key that asks (its owner id names the job's owner, its terms its fair
    share); ``priority``: ``BATCH`` for batch lines; ``images``: the chat request's, loaded.
    RelayError (400) for what the request cannot be."""
    created, owner = int(time.time()), tenant.owner
    share = _share(tenant, request.priority if isinstance(request, SamplingFields) else 0)
    if isinstance(request, ChatCompletionRequest):
        return ChatJob(
            job_id=job_id_for("chatcmpl", request_id, is_ours), request_id=request_id, created=created,
            tenant=owner, request=chat_generate(request, priority, images.refs), delivery=_delivery(request),
            affinity=_affinity(request), **share,
        )  # fmt: skip
    if isinstance(request, CompletionRequest):
        return CompletionJob(
            job_id=job_id_for("cmpl", request_id, is_ours), request_id=request_id, created=created, tenant=owner,
            request=completion_generate(request, priority), delivery=_delivery(request, echo=request.echo), **share,
        )  # fmt: skip
    return EmbeddingJob(
        job_id=job_id_for("embd", request_id, is_ours), request_id=request_id, created=created, tenant=owner,
        request=Embed(model=request.model, inputs=request.inputs, dimensions=request.dimensions),
        delivery=Delivery(encoding_format=request.encoding_format), **share,
    )  # fmt: skip


def _share(tenant: Tenant, priority: int) -> dict[str, Any]:
    """The job's place in the fair share (``shared.fair_share``): its client's priority orders its
    key's own jobs, and ranks it across keys only where the key's terms allow."""
    band = priority if tenant.ranks_across_tenants else 0
    return {"queue_priority": priority, "share_weight": tenant.weight, "share_band": band}


def tokenize_job(request: Tokenize, request_id: str, is_ours: bool, tenant: str | None) -> TokenizeJob:
    job_id = job_id_for("tok", request_id, is_ours)
    return TokenizeJob(job_id=job_id, request_id=request_id, created=int(time.time()), tenant=tenant, request=request)


CHARS_PER_TOKEN = 4
"""What a prompt's size is estimated with before any tokenizer sees it (English text, BPE)."""


def prompt_token_estimate(job: AnyJob) -> int:
    """The job's prompt tokens as queued work: its text at ``CHARS_PER_TOKEN`` (token-id prompts
    counted exactly), for the queued-prefill gauge that scales workers; 0 for audio and tokenize."""
    request = job.request
    if isinstance(request, Generate):
        if request.messages is not None:
            text = sum(len(message.model_dump_json()) for message in request.messages)
            text += sum(len(tool.model_dump_json()) for tool in request.tools)
            return text // CHARS_PER_TOKEN
        prompts = request.prompts or []
        return sum(len(prompt) if isinstance(prompt, list) else len(prompt) // CHARS_PER_TOKEN for prompt in prompts)
    if isinstance(request, Embed):
        return sum(len(item) if isinstance(item, list) else len(item) // CHARS_PER_TOKEN for item in request.inputs)
    return 0


def _affinity(request: SamplingFields) -> tuple[str, ...]:
    """What names the request's conversation for placement: its ``prompt_cache_key``, else its
    ``user`` (OpenAI's order: the cache key replaces the user for caching)."""
    if request.prompt_cache_key:
        return (f"prompt_cache_key:{request.prompt_cache_key}",)
    return (f"user:{request.user}",) if request.user else ()


def _delivery(request: SamplingFields, echo: bool = False) -> Delivery:
    background = isinstance(request, ChatCompletionRequest) and request.background
    return Delivery(
        stream=request.stream, include_usage=request.include_usage, resumable=request.resumable,
        background=background, echo=echo,
    )  # fmt: skip


# -- chat ---------------------------------------------------------------------------------------


def chat_generate(
    request: ChatCompletionRequest,
    priority: int = INTERACTIVE,
    images: Mapping[ImageLocator, ImageRef] | None = None,
) -> Generate:
    """The engine request of a chat request (also of Responses and Messages, which become one);
    ``images``: what each image part names, as ``api.images.request.load_images`` loaded them."""
    tool_choice, tool_name = _tool_choice(request)
    generate = Generate(
        model=request.model,
        messages=[_message(message, images or {}) for message in request.messages],
        tools=[_tool(tool) for tool in request.tools or []],
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=request.parallel_tool_calls,
        output=_output_format(request),
        chat_template_kwargs=request.chat_template_kwargs or {},
        sampling=_sampling(request, request.max_new_tokens, request.max_new_tokens_param, request.logprob_count),
        priority=priority,
    )
    if generate.is_constrained:
        _check_constrainable(request)
    return generate


def _text(content: MessageContent | None) -> str:
    """Text parts are joined with newlines, as vLLM does for text-only templates."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _user_content(content: UserMessageContent, images: Mapping[ImageLocator, ImageRef]) -> str | list[Part]:
    """Text alone stays one string (a text-only job is what it always was); with images, the
    parts in the order the client sent them."""
    if isinstance(content, str):
        return content
    texts = [part.text for part in content if isinstance(part, TextContentPart)]
    if len(texts) == len(content):
        return "\n".join(texts)  # as _text joins them
    return [_part(part, images) for part in content]


def _part(part: UserContentPart, images: Mapping[ImageLocator, ImageRef]) -> Part:
    if isinstance(part, TextContentPart):
        return TextPart(text=part.text)
    image = images.get(part.locator)
    if image is None:
        # Every route that takes images loads them first; a batch line has none (refused when checked).
        raise RelayError(ErrorKind.INVALID_REQUEST, "Image input is not taken on this endpoint.", "messages")
    return ImagePart(image=image)


def _message(message: ChatMessage, images: Mapping[ImageLocator, ImageRef]) -> Message:
    if isinstance(message, SystemMessage):
        return Message(role="system", content=_text(message.content))
    if isinstance(message, AssistantMessage):
        calls = [
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in message.tool_calls or []
        ]
        return Message(
            role="assistant", content=_text(message.content), tool_calls=calls,
            reasoning_content=message.reasoning_content,
        )  # fmt: skip
    if isinstance(message, ToolMessage):
        return Message(role="tool", content=_text(message.content), tool_call_id=message.tool_call_id)
    return Message(role="user", content=_user_content(message.content, images))


def _tool(tool: ToolDefinition) -> Tool:
    function = tool.function
    return Tool(
        name=function.name, description=function.description, parameters=function.parameters, strict=function.strict
    )


def _tool_choice(request: ChatCompletionRequest) -> tuple[ToolChoice, str | None]:
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        if not request.tools:
            raise RelayError(ErrorKind.INVALID_REQUEST, "tool_choice requires 'tools' to be set", "tool_choice")
        if all(tool.function.name != choice.function.name for tool in request.tools):
            message = f"tool_choice names {choice.function.name!r}, which is not in 'tools'"
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "tool_choice")
        return "function", choice.function.name
    if choice == "required" and not request.tools:
        raise RelayError(ErrorKind.INVALID_REQUEST, "tool_choice requires 'tools' to be set", "tool_choice")
    return choice or "auto", None


def _output_format(request: ChatCompletionRequest) -> OutputFormat | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return OutputFormat(type="json_object")
    block = response_format.json_schema
    if block is None:
        message = "response_format json_schema requires 'json_schema'"
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "response_format")
    # OpenAI makes the schema optional; without one the only promise left is a JSON object.
    return OutputFormat(type="json_schema", json_schema=block.schema_, strict=bool(block.strict))


def _check_constrainable(request: ChatCompletionRequest) -> None:
    """A grammar ends in the stop token; settings that forbid or ignore it cannot be honoured."""
    for name in ("ignore_eos", "min_tokens"):
        if getattr(request, name):
            message = f"{name} cannot be combined with response_format or a forced tool_choice"
            raise RelayError(ErrorKind.INVALID_REQUEST, message, name)


# -- completions and the fields both share ------------------------------------------------------


def completion_generate(request: CompletionRequest, priority: int = INTERACTIVE) -> Generate:
    return Generate(
        model=request.model,
        prompts=request.prompts,
        sampling=_sampling(request, request.max_tokens, "max_tokens", request.logprobs),
        priority=priority,
    )


def _sampling(request: SamplingFields, max_tokens: int | None, max_tokens_param: str, logprobs: int | None) -> Sampling:
    return Sampling(
        n=request.n,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k, 0),
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        seed=request.seed,
        logit_bias=[(int(token), bias) for token, bias in (request.logit_bias or {}).items()],
        logprobs=logprobs,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop=request.stop_sequences,
        include_stop_str_in_output=request.include_stop_str_in_output,
        stop_token_ids=list(request.stop_token_ids or ()),
        skip_special_tokens=request.skip_special_tokens,
    )
