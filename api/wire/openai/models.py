"""``GET /v1/models`` response."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "relaylm"
    max_model_len: int | None = Field(default=None, description="Extension: the context length served.")
    num_live_workers: int = Field(
        default=0, description="Extension: ready workers serving this model now (loading ones are not counted)."
    )
    num_loading_workers: int = Field(
        default=0,
        description="Extension: workers still loading this model; a request waits queued for one to be ready "
        "(for --no-worker-grace-s at most when none is ready).",
    )
    task: str = Field(
        default="generate", description="Extension: generate (chat, completions), embed or transcribe (audio)."
    )
    parent: str | None = Field(
        default=None, description="Extension (as vLLM's): the base model of a LoRA adapter; null for a model."
    )
    deterministic: bool = Field(
        default=False,
        description="Extension: every ready worker of the model (at least one) promises that a greedy or "
        "seeded request's text depends on the request alone (not on the batch, the cache, the thread count or "
        "a failover).",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
