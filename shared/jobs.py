"""The job a worker receives: the validated OpenAI request plus what the API decided about it.

The payload is stored in the job's record (``RedisKeys.job``, field ``request``); queues carry only
the job id, so prompts never appear in queue log lines. It is JSON, not msgpack: tool schemas
are arbitrary JSON, whose integers may exceed msgpack's 64 bits.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, TypeAdapter

from shared.openai.chat_request import ChatCompletionRequest
from shared.openai.completion_request import CompletionRequest
from shared.openai.embeddings import EmbeddingRequest


class _JobFields(BaseModel):
    def model_post_init(self, context: object) -> None:
        self.model_fields_set.add("kind")  # the discriminator must survive exclude_unset

    job_id: str = Field(description="Also the response id, e.g. chatcmpl-… or cmpl-….")
    request_id: str | None = Field(default=None, description="X-Request-Id, for following the job through logs.")
    created: int = Field(description="Unix seconds, the `created` of every chunk.")
    tenant: str | None = Field(
        default=None, description="Owner id (keyed hash) of the API key that submitted it; None without keys."
    )


class ChatJob(_JobFields):
    kind: Literal["chat"] = "chat"
    request: ChatCompletionRequest


class TokenizeRequest(BaseModel):
    """What a tokenize job asks (exactly one of ``chat``, ``prompt`` and ``tokens``): the prompt
    a chat request renders to, a text's tokens, or the text of tokens (detokenize)."""

    model: str
    chat: ChatCompletionRequest | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    tokens: list[int] | None = None

    @property
    def stream(self) -> bool:
        return False  # answered in one piece

    @property
    def resumable(self) -> bool:
        return False  # a client that leaves cancels it

    @property
    def n(self) -> int:
        return 1  # one answer


class TokenizeJob(_JobFields):
    """Tokenize or detokenize with the model's own tokenizer and chat template (count_tokens,
    /tokenize, /detokenize): the worker answers with a start, one delta (the token ids and
    text) and an end event, and generates nothing."""

    kind: Literal["tokenize"] = "tokenize"
    request: TokenizeRequest


class CompletionJob(_JobFields):
    kind: Literal["completion"] = "completion"
    request: CompletionRequest


class EmbeddingJob(_JobFields):
    kind: Literal["embedding"] = "embedding"
    request: EmbeddingRequest


AnyJob = ChatJob | CompletionJob | EmbeddingJob | TokenizeJob
_job_adapter: TypeAdapter[AnyJob] = TypeAdapter(Annotated[AnyJob, Field(discriminator="kind")])


def encode_job(job: AnyJob) -> bytes:
    # exclude_unset keeps an explicit null (e.g. max_tokens) apart from an omitted field.
    return job.model_dump_json(by_alias=True, exclude_unset=True).encode()


def decode_job(payload: bytes) -> AnyJob:
    """Raises ValueError (pydantic's ValidationError) for anything but a JSON job."""
    return _job_adapter.validate_json(payload)
