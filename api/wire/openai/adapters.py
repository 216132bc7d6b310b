"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: vLLM's requests, and what relaylm answers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(description="The name clients send as `model` to use it.")
    lora_path: str = Field(
        description="A PEFT folder (adapter_config.json, adapter_model.safetensors) on the API's host."
    )
    load_inplace: bool = Field(default=False, description="Replace an adapter stored under the same name.")
    base_model_name: str | None = Field(
        default=None,
        description="Extension: the model it adapts; may be left out where one generation model is served.",
    )


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = Field(default=None, description="vLLM's numeric id; accepted and not used.")


class LoraAdapter(BaseModel):
    id: str
    object: Literal["lora_adapter"] = "lora_adapter"
    parent: str = Field(description="The model it adapts.")
    rank: int
    targets: list[str]
    size: int = Field(description="Bytes of both files, as stored.")
    sha256: str


class LoraAdapterDeleted(BaseModel):
    id: str
    object: Literal["lora_adapter.deleted"] = "lora_adapter.deleted"
    deleted: bool = True
