"""An adapter made ready for the worker's loaded model: checked against its shapes, then on the
kernels the model's own matmuls run on."""

from __future__ import annotations

from shared.adapter_files import check_fits
from worker.native.decoder import NativeCausalLM
from worker.native.lora import LoraModel, model_shapes, prepare
from worker.native.peft_format import PeftAdapter


def for_model(
    model: NativeCausalLM, name: str, digest: str, adapter: PeftAdapter, max_rank: int, exact: bool
) -> LoraModel:
    """``AdapterError`` where ``adapter`` does not fit ``model``; ``exact``: the execution plan's
    numerics are the exact kernels' (the updates then run on them too)."""
    check_fits(adapter.updates, model_shapes(model.config, max_rank))
    return prepare(name, digest, adapter, model.config, model.dtype, exact)
