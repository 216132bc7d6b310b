"""The deterministic forward (``--deterministic on``): the native decoder's matmuls, norms and
attention on relaylm's exact kernels (``exact.py``), so a row's bits are a function of that row.

Weights: a 4-bit GGUF's own groups where the checkpoint carries them exactly (no re-quantization,
``gguf_groups.py``), 8-bit groups of 32 (llama.cpp's Q8_0) for every other matmul and for the head
(at 4 bits the head cost most of the quality; ``bench/quantization_bench.py``). ``--quantization``
chooses: ``auto`` as just said, ``int8`` 8-bit everywhere, ``int4`` 4-bit everywhere (the GGUF's
groups, else quantized here). The float copies of the replaced weights are dropped, so the model
holds its weights once, in the bytes the kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.native import exact
from worker.native.decoder import MLP, ExactMlp, ExactParts, JoinedLinear, Linear, NativeCausalLM, RMSNorm
from worker.native.experts import ExactExperts, SparseMoe
from worker.native.gguf_groups import Int4Groups
from worker.native.quantize import Quantization, quantize_int4_groups


@dataclass
class ExactSummary:
    """What ``make_exact`` packed: weight counts by kind and the bytes the kernels read."""

    gguf_int4: int = 0
    int4: int = 0
    int8: int = 0
    nbytes: int = 0

    def __str__(self) -> str:
        return (f"{self.gguf_int4} matmuls on the GGUF's 4-bit groups, {self.int4} quantized to 4 bits, "
                f"{self.int8} 8-bit, {self.nbytes / 2**20:.0f} MiB of weights")  # fmt: skip


def _groups_of(groups: dict[str, Int4Groups], name: str, linear: Linear) -> Int4Groups | None:
    """The checkpoint's own groups of ``name`` (a joined projection's parts, in row order)."""
    if isinstance(linear, JoinedLinear):
        keys = [f"{name}.{part}.weight" for part in linear.part_names]
    else:
        keys = [f"{name}.weight"]
    found = [groups[key] for key in keys if key in groups]
    return Int4Groups.joined(found) if len(found) == len(keys) else None


def _pack(
    linear: Linear, name: str, groups: dict[str, Int4Groups], mode: Quantization, summary: ExactSummary
) -> exact.PackedWeight:
    own = _groups_of(groups, name, linear) if mode in ("auto", "int4") else None
    if own is not None:
        summary.gguf_int4 += 1
        packed = own.pack()
    elif mode == "int4" and linear.weight.shape[1] % exact.GROUP == 0:
        summary.int4 += 1
        made = quantize_int4_groups(linear.weight)
        packed = exact.pack_int4(made.values, made.group_scale, made.group_min)
    else:
        summary.int8 += 1
        packed = exact.pack_int8(linear.weight)
    summary.nbytes += packed.nbytes
    return packed


def _exact(
    linear: Linear, name: str, groups: dict[str, Int4Groups], mode: Quantization, summary: ExactSummary,
    prologue: int = exact.PROLOGUE_NONE, norm: RMSNorm | None = None,
) -> exact.ExactLinear:  # fmt: skip
    packed = _pack(linear, name, groups, mode, summary)
    norm_weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
    return exact.ExactLinear(packed, linear.bias, prologue, norm_weight, eps)


def _drop(weight: torch.Tensor, module: torch.nn.Module, name: str = "weight") -> None:
    setattr(module, name, torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False))


def _exact_mlp(
    mlp: MLP | SparseMoe, name: str, norm: RMSNorm, groups: dict[str, Int4Groups], mode: Quantization,
    summary: ExactSummary,
) -> ExactMlp | ExactExperts:  # fmt: skip
    if isinstance(mlp, MLP):
        assert mlp.gate_up_proj is not None, "join_projections() runs first"
        parts = ExactMlp(
            gate_up=_exact(mlp.gate_up_proj, name, groups, mode, summary, exact.PROLOGUE_RMS_NORM, norm),
            down=_exact(mlp.down_proj, f"{name}.down_proj", groups, mode, summary, exact.PROLOGUE_SILU_MUL),
        )
        _drop(mlp.gate_up_proj.weight, mlp.gate_up_proj)
        _drop(mlp.down_proj.weight, mlp.down_proj)
        return parts
    experts = mlp.experts
    gate_up, down = [], []
    for expert in range(mlp.moe.num_experts):
        gate_up.append(_pack(Linear.of(experts.gate_up_proj[expert]), f"{name}.experts.{expert}.gate_up_proj", groups,
                             mode, summary))  # fmt: skip
        down.append(_pack(Linear.of(experts.down_proj[expert]), f"{name}.experts.{expert}.down_proj", groups, mode,
                          summary))  # fmt: skip
    # 8-bit: the router is small, and a coarser one changes which experts a token gets.
    router = exact.pack_int8(mlp.gate.weight)
    summary.int8 += 1
    summary.nbytes += router.nbytes
    parts_moe = ExactExperts.build(mlp.moe, router, gate_up, down, norm.weight, norm.eps)
    _drop(experts.gate_up_proj, experts, "gate_up_proj")
    _drop(experts.down_proj, experts, "down_proj")
    _drop(mlp.gate.weight, mlp.gate)
    return parts_moe


def make_exact(model: NativeCausalLM, groups: dict[str, Int4Groups], mode: Quantization) -> ExactSummary:
    """Put every layer and the head on the exact kernels (``mode``: see the module docstring;
    ``none`` is not one of them: the caller keeps the library kernels then)."""
    if mode == "none":
        raise ValueError("the exact kernels always quantize: --quantization none needs --deterministic off")
    if model.device.type != "cpu":
        raise ValueError(f"the exact kernels run on the CPU; this model is on {model.device}")
    summary = ExactSummary()
    for index, layer in enumerate(model.model.decoder_layers()):
        prefix = f"model.layers.{index}"
        attention = layer.self_attn
        assert attention.qkv_proj is not None, "join_projections() runs first"
        layer.exact = ExactParts(
            qkv=_exact(attention.qkv_proj, f"{prefix}.self_attn", groups, mode, summary,
                       exact.PROLOGUE_RMS_NORM, layer.input_layernorm),
            o=_exact(attention.o_proj, f"{prefix}.self_attn.o_proj", groups, mode, summary),
            mlp=_exact_mlp(layer.mlp, f"{prefix}.mlp", layer.post_attention_layernorm, groups, mode, summary),
        )  # fmt: skip
        # The kernels hold the weights now; the float copies would only double the memory.
        for linear in (attention.qkv_proj, attention.o_proj):
            _drop(linear.weight, linear)
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    packed = exact.pack_int8(head)  # the embedding keeps its own rows for lookups
    summary.int8 += 1
    summary.nbytes += packed.nbytes
    model.exact_head = exact.ExactLinear(
        packed, None, exact.PROLOGUE_RMS_NORM, model.model.norm.weight, model.model.norm.eps, out_float32=True
    )
    model.head = None
    model.lm_head = None
    return summary
