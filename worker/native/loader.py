"""Build the native decoder on the meta device (no random init of weights about to be replaced)
and assign the checkpoint's tensors to it, cast to the serving dtype on the serving device."""

from __future__ import annotations

import re

import torch
from safetensors.torch import load_file

from worker.native.decoder import NativeCausalLM
from worker.native.spec import DecoderSpec, UnsupportedCheckpoint

# One expert's projection, as published checkpoints name it.
_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
# Names some checkpoints carry that the decoder computes instead.
_COMPUTED = ("rotary_emb.inv_freq",)


def load_native(spec: DecoderSpec, dtype: torch.dtype, device: torch.device) -> NativeCausalLM:
    with torch.device("meta"):
        model = NativeCausalLM(spec)
    expected = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for path in spec.weight_files:
        for checkpoint_name, tensor in load_file(str(path), device=str(device)).items():
            name = _decoder_name(checkpoint_name, spec)
            if name is None:
                continue  # another part's weight (a vision tower's)
            if _EXPERT.fullmatch(name):
                experts[name] = tensor.to(dtype)
            elif name in expected:
                state[name] = tensor.to(dtype)
            elif not (name.endswith(_COMPUTED) or (name == "lm_head.weight" and spec.tie_word_embeddings)):
                raise UnsupportedCheckpoint(f"{path.name}: unexpected weight {name!r} for a {spec.model_type} decoder")
    if experts:
        state.update(_stacked_experts(experts, spec))
    missing = expected - state.keys()
    if missing:
        raise UnsupportedCheckpoint(f"the checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    model.load_state_dict(state, assign=True, strict=True)
    model.join_projections()
    model.set_rope(device)
    return model.eval().requires_grad_(False)


def _stacked_experts(experts: dict[str, torch.Tensor], spec: DecoderSpec) -> dict[str, torch.Tensor]:
    """Published MoE checkpoints hold each expert's projections apart; the decoder holds them
    stacked (``experts.py``)."""
    assert spec.moe is not None, "expert weights in a checkpoint without experts"
    stacked: dict[str, torch.Tensor] = {}
    for layer in sorted(spec.moe.sparse_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        try:
            gate_up = [
                torch.cat([experts.pop(f"{prefix}.{e}.{part}_proj.weight") for part in ("gate", "up")])
                for e in range(spec.moe.num_experts)
            ]
            down = [experts.pop(f"{prefix}.{e}.down_proj.weight") for e in range(spec.moe.num_experts)]
        except KeyError as exc:
            raise UnsupportedCheckpoint(f"the checkpoint lacks expert weight {exc.args[0]!r}") from exc
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{prefix}.down_proj"] = torch.stack(down)
    if experts:
        raise UnsupportedCheckpoint(f"unexpected expert weight {sorted(experts)[0]!r}")
    return stacked


def _decoder_name(name: str, spec: DecoderSpec) -> str | None:
    """The decoder's name for a checkpoint weight; None for a weight of another part."""
    if name.startswith(spec.body_prefix):
        return "model." + name[len(spec.body_prefix) :]
    if name.startswith(spec.foreign_prefixes):
        return None
    return name
