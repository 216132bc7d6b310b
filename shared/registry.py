"""The worker registry's record formats: workers write them, the API reads them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from shared.adapter_files import ModelShapes

WorkerState = Literal["loading", "ready", "draining"]
WorkerTask = Literal["generate", "embed", "transcribe"]
WorkerLanes = Literal["all", "interactive", "batch"]


class WorkerInfo(BaseModel):
    """One worker's heartbeat, stored as JSON under ``RedisKeys.worker`` with a short TTL."""

    worker_id: str
    instance: str = Field(
        default="", description="Random per process: a worker restarted under the same id is another owner."
    )
    model: str
    task: WorkerTask = "generate"
    state: WorkerState = Field(
        description="loading (registered, its model not yet serving: it claims no job), ready, or draining "
        "(after SIGTERM: it claims no job and finishes its running ones)."
    )
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    max_num_seqs: int = 0
    max_model_len: int = 0
    num_running: int = Field(default=0, description="Sequences in the running batch.")
    num_waiting: int = Field(default=0, description="Sequences admitted to the engine but not yet running.")
    prefix_cache_hit_rate: float = Field(default=0.0, description="Prompt tokens served from the prefix cache.")
    kv_cache_usage: float = Field(default=0.0, description="Share of the KV budget's blocks held (0-1).")
    num_jobs: int = Field(default=0, description="Jobs its queue consumers hold; with none it leaves its cores.")
    cpus: list[int] = Field(default_factory=list, description="The CPUs it may run on (its affinity); empty: unknown.")
    compiled_decode: str = Field(
        default="off", description="One stream's compiled decode step: off, building, ready or failed."
    )
    sizes_own_threads: bool = Field(
        default=False, description="Its torch threads follow its share of the cores (no --num-threads given)."
    )
    contract_version: int = Field(
        default=1,
        description="The newest job contract version it reads (records without it are of version-1 workers).",
    )
    vision: bool = Field(default=False, description="It takes images in chat messages (a vision-language model).")
    lanes: WorkerLanes = Field(
        default="all", description="The queues it claims from: all, interactive (requests) or batch (batch lines)."
    )
    images_encoded: int = Field(default=0, description="Images its vision tower encoded since it started.")
    image_cache_hits: int = Field(default=0, description="Images served from its image-embedding cache instead.")
    vision_encode_seconds: float = Field(default=0.0, description="Time its vision tower spent encoding images.")
    speculative: Literal["ngram", "off"] = Field(
        default="off", description="How it speculates: ngram (drafts from each sequence's own tokens) or off."
    )
    spec_decode_num_draft_tokens: int = Field(default=0, description="Tokens it drafted since it started.")
    spec_decode_num_accepted_tokens: int = Field(
        default=0, description="Drafted tokens it kept (each the token sampled at its position) since it started."
    )
    deterministic: bool = Field(
        default=False,
        description="A request's text depends on the request alone here: exact kernels, and its load-time "
        "self-test (alone, batched, cached, other thread counts) passed.",
    )
    lora: ModelShapes | None = Field(
        default=None,
        description="What a LoRA adapter of its model must fit (projection shapes, the largest rank it serves); "
        "None: it serves no adapters.",
    )
    english_only: bool = Field(
        default=False,
        description="A Whisper model that knows English alone: it cannot translate nor take another language "
        "(records without it: the worker refuses such requests itself).",
    )


class ModelRecord(BaseModel):
    """A model that some worker served; kept after its workers die so the API answers 503, not 404.

    Its ready workers write it on every heartbeat; a loading or draining worker only creates it
    when it is missing (the model is then known, and a request for it waits for a ready worker),
    so ``last_seen``, ``max_model_len`` and ``vision`` are always what a ready worker said."""

    model: str
    first_seen: float
    last_seen: float = Field(description="The last heartbeat of a ready worker of the model (or its creation).")
    max_model_len: int = 0
    task: WorkerTask = "generate"
    vision: bool = Field(default=False, description="Its workers take images in chat messages.")
