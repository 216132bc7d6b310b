"""The job contract as this release writes it: the engine-native request and the job around it.

The contract grows by fields. Each field, or new form of a field's value, added after version 2
says since which version it exists (``Since``, ``since.py``); a payload for an older reader is
this one with those fields left out while they hold their defaults, and a job whose values need a
newer version is not written for an older reader at all. Every model forbids unknown fields, so
a payload is read exactly or not at all, never misread.

| version | adds |
|---|---|
| 2 | the engine-native request; messages are text only |
| 3 | chat messages that carry images (``Message.content`` as text and image parts) |
| 4 | ``Sampling.include_stop_str_in_output`` |
| 5 | ``Generate.adapter``: a LoRA adapter over the model |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.contract.since import Since

VERSION = 5
"""The version this code writes and the newest it reads."""


def _renumbered(data: dict[str, Any], version: int) -> dict[str, Any]:
    return {**data, "version": version}


# Version n's payload as version n + 1. Frozen: a version that only adds fields (or new forms of
# a value) reads every payload of the one before it as it stands.
UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    2: lambda data: _renumbered(data, 3),  # 3 adds image parts
    3: lambda data: _renumbered(data, 4),  # 4 adds Sampling.include_stop_str_in_output
    4: lambda data: _renumbered(data, 5),  # 5 adds Generate.adapter
}


class _Contract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- generation ---------------------------------------------------------------------------------


class ToolCall(_Contract):
    """A call an earlier assistant turn made (for the chat template)."""

    id: str
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model produced them.")


class ImageRef(_Contract):
    """An image the API fetched, decoded and stored; its bytes are ``RedisKeys.image(sha256)``,
    which is also what the worker's caches key it by."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Of the image's bytes as stored.")
    media_type: str = Field(description="What Pillow decoded it as, e.g. image/png.")
    width: int = Field(ge=1)
    height: int = Field(ge=1)


class TextPart(_Contract):
    type: Literal["text"] = "text"
    text: str


class ImagePart(_Contract):
    type: Literal["image"] = "image"
    image: ImageRef


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _has_parts(content: object) -> bool:
    return not isinstance(content, str)


class Message(_Contract):
    """One chat turn, in the roles chat templates know: its text (text parts already joined), or,
    when it holds an image, its text and image parts in order."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str | list[Part], Since(3, needs=_has_parts, what="images")]
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @property
    def images(self) -> list[ImageRef]:
        if isinstance(self.content, str):
            return []
        return [part.image for part in self.content if isinstance(part, ImagePart)]


class Tool(_Contract):
    """A function the model may call: OpenAI's function definition, field for field."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


ToolChoice = Literal["auto", "none", "required", "function"]
"""``function``: exactly one call of ``Generate.tool_name``."""


class OutputFormat(_Contract):
    """A constraint on the text itself: any JSON object, or JSON valid against ``json_schema``."""

    type: Literal["json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(default=None, description="None with json_schema: any JSON object.")
    strict: bool = False


class Sampling(_Contract):
    """Everything that becomes the engine's sampling parameters, in engine terms."""

    n: int = Field(default=1, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(default=0, ge=0, description="0: every token.")
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: list[tuple[int, float]] = Field(default_factory=list)
    logprobs: int | None = Field(default=None, description="None: none; k: the chosen token's and the k likeliest.")
    max_tokens: int | None = Field(default=None, description="None: as many as the context has room for.")
    max_tokens_param: str = Field(default="max_tokens", description="The client's name for it, for error messages.")
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = Field(default_factory=list)
    include_stop_str_in_output: Annotated[bool, Since(4)] = Field(
        default=False, description="A matched stop string ends the text instead of being cut from it."
    )
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True


class Generate(_Contract):
    """Generate from chat ``messages`` (through the model's chat template) or raw ``prompts``."""

    task: Literal["generate"] = "generate"
    model: str
    messages: list[Message] | None = None
    prompts: list[str] | list[list[int]] | None = Field(
        default=None, description="Text or token-id prompts; each gets ``n`` choices."
    )
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    output: OutputFormat | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    sampling: Sampling = Field(default_factory=Sampling)
    priority: int = Field(default=0, description="0: interactive; 1: batch lines (run with spare capacity).")
    adapter: Annotated[str | None, Since(5)] = Field(
        default=None,
        description="A LoRA adapter of ``model`` (``shared.adapters``) that the worker applies; the name the client "
        "asked for, which responses name as their model.",
    )

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def served_name(self) -> str:
        """What the client asked for and responses name: the adapter, else the model."""
        return self.adapter or self.model

    @property
    def images(self) -> list[ImageRef]:
        """Every image of the conversation, in order (repeats included)."""
        return [image for message in self.messages or [] for image in message.images]

    @property
    def is_constrained(self) -> bool:
        """The grammar decides the output: a forced tool call or a JSON output format."""
        return self.tool_choice in ("required", "function") or self.output is not None


class Embed(_Contract):
    task: Literal["embed"] = "embed"
    model: str
    inputs: list[str] | list[list[int]]
    dimensions: int | None = None


class Tokenize(_Contract):
    """Exactly one of ``chat`` (the prompt it renders to), ``prompt`` (a text's tokens) and
    ``tokens`` (their text): count_tokens, /tokenize, /detokenize. Nothing is generated."""

    task: Literal["tokenize"] = "tokenize"
    model: str
    chat: Generate | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    tokens: list[int] | None = None


class Transcribe(_Contract):
    """Transcribe (or translate to English) one window of a recording.

    A recording is cut at silences into windows by the API; each window is one job, so several
    workers transcribe one long file together. The window's audio is not in the payload: it is
    16 kHz mono little-endian int16 PCM under ``RedisKeys.job_audio(job_id)``, with its own short
    TTL, deleted once the API has the window's text (job records stay for a day; a recording's
    samples should not)."""

    task: Literal["transcribe"] = "transcribe"
    model: str
    window: int = Field(ge=0, description="This window's position among the recording's windows.")
    num_windows: int = Field(ge=1)
    offset_s: float = Field(ge=0, description="Where the window starts in the recording.")
    duration_s: float = Field(ge=0)
    translate: bool = Field(default=False, description="Translate to English instead of transcribing.")
    language: str | None = Field(default=None, description="ISO-639-1; None: detected per window.")
    prompt: str | None = None
    temperature: float = Field(default=0.0, ge=0, le=1)
    seed: int = Field(
        default=0,
        description="The sampler's seed when temperature > 0. CTranslate2 seeds each of its threads once, so "
        "sampled text is not repeatable; at temperature 0 (the default) a window's text is.",
    )
    word_timestamps: bool = False


# -- the job ------------------------------------------------------------------------------------


class Delivery(_Contract):
    """How the API renders the job's events for its client. Workers never read it, so it is not
    part of what they read: the API keeps it in the job's record (``encode_delivery``), and a
    change to it is the API's alone."""

    stream: bool = False
    include_usage: bool = False
    resumable: bool = Field(default=False, description="Keep running when the client leaves (Last-Event-ID).")
    background: bool = False
    echo: bool = Field(default=False, description="A completion's text starts with its prompt.")
    encoding_format: Literal["float", "base64"] = "float"


class _Job(_Contract):
    version: Literal[5] = 5
    job_id: str = Field(description="Also the response id, e.g. chatcmpl-… or cmpl-….")
    request_id: str | None = Field(default=None, description="X-Request-Id, for following the job through logs.")
    created: int = Field(description="Unix seconds, the `created` of every chunk.")
    tenant: str | None = Field(default=None, description="Owner id (keyed hash) of the API key; None without keys.")
    delivery: Delivery = Field(
        default_factory=Delivery,
        exclude=True,
        description="The API's alone: kept in the job's record beside the payload, never written into it.",
    )
    affinity: tuple[str, ...] = Field(
        default=(),
        exclude=True,
        description="The API's alone: what names the job's conversation besides its messages (a client's "
        "prompt_cache_key or user, a Responses chain), for placement (``shared.placement``); never written.",
    )

    queue_priority: int = Field(
        default=0,
        exclude=True,
        description="The API's alone: the client's priority (lower is sooner) among its tenant's queued jobs; never "
        "written.",
    )
    share_weight: float = Field(
        default=1.0,
        gt=0,
        exclude=True,
        description="The API's alone: its key's weight in the fair share; never written.",
    )
    share_band: int = Field(
        default=0,
        exclude=True,
        description="The API's alone: the priority that ranks it across tenants (0 unless its key may); never written.",
    )

    @property
    def model(self) -> str:
        """The model whose workers run it (a LoRA adapter's base model)."""
        return self.request.model  # type: ignore[attr-defined]

    @property
    def served_name(self) -> str:
        """The model its responses name: the LoRA adapter it runs on, else its model."""
        request = self.request  # type: ignore[attr-defined]
        return request.served_name if isinstance(request, Generate) else self.model

    @property
    def n(self) -> int:
        """Choices per prompt: a generation's ``n``, one for anything else."""
        request = self.request  # type: ignore[attr-defined]
        return request.sampling.n if isinstance(request, Generate) else 1


class ChatJob(_Job):
    kind: Literal["chat"] = "chat"
    request: Generate


class CompletionJob(_Job):
    kind: Literal["completion"] = "completion"
    request: Generate


class EmbeddingJob(_Job):
    kind: Literal["embedding"] = "embedding"
    request: Embed


class TokenizeJob(_Job):
    kind: Literal["tokenize"] = "tokenize"
    request: Tokenize


class TranscriptionJob(_Job):
    """One window of a transcription or translation. A new kind, not a new version: only workers
    started on a Whisper model take these jobs, and every such worker reads this version."""

    kind: Literal["transcription"] = "transcription"
    request: Transcribe


AnyJob = ChatJob | CompletionJob | EmbeddingJob | TokenizeJob | TranscriptionJob


def images_of(job: AnyJob) -> list[ImageRef]:
    """The images a job's worker reads from Redis."""
    request = job.request
    if isinstance(request, Generate):
        return request.images
    if isinstance(request, Tokenize) and request.chat is not None:
        return request.chat.images
    return []
