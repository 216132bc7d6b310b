"""Build the native decoder on the meta device (no random init of weights about to be replaced)
and assign the checkpoint's tensors to it, cast to the serving dtype on the serving device."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from worker.native.decoder import NativeCausalLM
from worker.native.spec import DecoderSpec, UnsupportedCheckpoint

# Names some checkpoints carry that the decoder computes instead.
_COMPUTED = ("rotary_emb.inv_freq",)


def load_native(spec: DecoderSpec, dtype: torch.dtype, device: torch.device) -> NativeCausalLM:
    with torch.device("meta"):
        model = NativeCausalLM(spec)
    expected = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for path in spec.weight_files:
        for checkpoint_name, tensor in load_file(str(path), device=str(device)).items():
            name = _decoder_name(checkpoint_name, spec)
            if name is None:
                continue  # another part's weight (a vision tower's)
            if name in expected:
                state[name] = tensor.to(dtype)
            elif not (name.endswith(_COMPUTED) or (name == "lm_head.weight" and spec.tie_word_embeddings)):
                raise UnsupportedCheckpoint(f"{path.name}: unexpected weight {name!r} for a {spec.model_type} decoder")
    missing = expected - state.keys()
    if missing:
        raise UnsupportedCheckpoint(f"the checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    model.load_state_dict(state, assign=True, strict=True)
    model.join_projections()
    model.set_rope(device)
    return model.eval().requires_grad_(False)


def _decoder_name(name: str, spec: DecoderSpec) -> str | None:
    """The decoder's name for a checkpoint weight; None for a weight of another part."""
    if name.startswith(spec.body_prefix):
        return "model." + name[len(spec.body_prefix) :]
    if name.startswith(spec.foreign_prefixes):
        return None
    return name
