"""An adapter made ready for the worker's loaded model: checked against its shapes, then on the
kernels the model's own matmuls run on."""

from __future__ import annotations

from shared.adapter_files import check_fits
from worker.native.decoder import NativeCausalLM
from worker.native.lora import LayerNorms, LoraModel, model_shapes, prepare
from worker.native.peft_format import PeftAdapter


def for_model(
    model: NativeCausalLM, name: str, digest: str, adapter: PeftAdapter, max_rank: int, exact: bool
) -> LoraModel:
    """``AdapterError`` where ``adapter`` does not fit ``model``; ``exact``: the execution plan's
    numerics are the exact kernels' (the updates then run on them too)."""
    check_fits(adapter.updates, model_shapes(model.config, max_rank))
    norms = None
    if exact:
        norms = [
            LayerNorms(
                (layer.input_layernorm.weight, layer.input_layernorm.eps),
                (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps),
            )
            for layer in model.model.decoder_layers()
        ]
    return prepare(name, digest, adapter, model.config, model.dtype, norms)
