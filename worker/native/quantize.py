"""Packed int8 / int4 weights for the native decoder's small decode batches on CPU
(``--quantization int8|int4``).

A decode step of a few rows reads every weight once and does little else with it: there the
read is the cost, and int8 weights halve the bytes of bf16 ones (int4: a quarter). Activations
stay in the serving dtype, and torch's packed kernels (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``) multiply without writing a dequantized copy. They loop over
rows, though: from ~5 rows on oneDNN's bf16 GEMM is faster, so matmuls of more than
``PACKED_MAX_ROWS`` rows (prefill chunks, busy batches) keep using the serving-dtype weights
(``bench/packed_matmul_bench.py`` times both). The cost is memory: the packed copy comes on top.

That switch makes a row's bits depend on how many rows share its step, so these copies serve
``--deterministic off`` only; ``--deterministic on`` multiplies on the exact kernels
(``deterministic.py``), whose quantized weights serve every row count.

FBGEMM's dynamic int8 (inputs quantized per tensor) is not offered: slower than int4 for one
stream, and its greedy text departs soonest (``bench/quantization_bench.py`` measures it). The token embedding
is a lookup and stays as it is; the LM head gets its own packed copy.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker.native.decoder import JoinedLinear, Linear, NativeCausalLM
from worker.native.gguf_groups import GROUP_SIZE, Int4Groups

Quantization = Literal["auto", "none", "int8", "int4"]
# The crossover bench/packed_matmul_bench.py measures on SmolLM2's shapes: at 4 rows the packed
# kernels still win, at 8 they lose.
PACKED_MAX_ROWS = 4


class _SmallBatchLinear(nn.Module):
    """``y = x W^T (+ b)``: a packed low-bit weight for up to ``max_rows`` input rows (None: every
    row count), the serving-dtype weight for more."""

    max_rows: int | None = PACKED_MAX_ROWS

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Buffer(weight.detach().to(dtype))
        self.bias = None if bias is None else nn.Buffer(bias.detach().to(dtype))

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.max_rows is not None and flat.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        out = self._packed_mm(flat.contiguous())
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


class Int8Linear(_SmallBatchLinear):
    """Int8 rows, one symmetric scale per row (``max |w| / 127``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight, bias, dtype)
        full = weight.detach().float()
        scales = (full.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        self.qweight = nn.Buffer(torch.round(full / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous())
        self.scales = nn.Buffer(scales.to(dtype))

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)


class Int4Linear(_SmallBatchLinear):
    """4-bit values in groups of ``GROUP_SIZE`` inputs, each group with its own scale and minimum
    (llama.cpp's Q4_1 scheme), packed for torch's CPU kernel (``aten._weight_int4pack_mm_for_cpu``).
    ``groups`` are a 4-bit GGUF's own (exact); without them the weight is quantized here."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, groups: Int4Groups | None = None
    ) -> None:
        super().__init__(weight, bias, dtype)
        in_features = weight.shape[1]
        if in_features % GROUP_SIZE:
            raise ValueError(f"int4 needs input widths that are multiples of {GROUP_SIZE}, not {in_features}")
        groups = groups or quantize_int4_groups(weight)
        self.packed = nn.Buffer(torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.values.to(torch.int32), 1))
        # The kernel computes (q - 8) * scale + zero: zero = min + 8 * scale gives q * scale + min.
        zeros = groups.group_min + 8 * groups.group_scale
        scales_and_zeros = torch.stack([groups.group_scale, zeros], dim=-1).transpose(0, 1)
        self.scales_and_zeros = nn.Buffer(scales_and_zeros.contiguous().to(dtype))

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP_SIZE, self.scales_and_zeros)


def quantize_int4_groups(weight: torch.Tensor) -> Int4Groups:
    """Each group of ``GROUP_SIZE`` inputs on 16 levels from its minimum to its maximum."""
    out_features, in_features = weight.shape
    grouped = weight.detach().float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
    values = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Groups(values.reshape(out_features, in_features), scales, low)


def _checkpoint_groups(groups: dict[str, Int4Groups], parent: str, name: str, linear: Linear) -> Int4Groups | None:
    """The checkpoint's own groups of one matmul, joined in row order for a ``JoinedLinear``."""
    names = linear.part_names if isinstance(linear, JoinedLinear) else (name,)
    found = [groups[key] for key in (f"{parent}.{part}.weight" for part in names) if key in groups]
    return Int4Groups.joined(found) if len(found) == len(names) else None


def resolve_mode(mode: Quantization, model: NativeCausalLM, groups: dict[str, Int4Groups]) -> Quantization:
    """``auto``: ``int4`` on the CPU when the checkpoint carries a 4-bit GGUF's own groups, else ``none``."""
    if mode != "auto":
        return mode
    return "int4" if model.device.type == "cpu" and groups else "none"


def quantize(model: NativeCausalLM, mode: Quantization, groups: dict[str, Int4Groups] | None = None) -> Quantization:
    """Replace the decoder's matmuls in place; returns the mode applied (``auto`` resolved).

    ``groups`` are the checkpoint's own 4-bit groups by weight name (``worker/native/gguf_groups.py``):
    ``int4`` packs those exactly and quantizes the rest, ``auto`` packs those and leaves the rest in
    the serving dtype. The head (tied embedding or ``lm_head``) is int8 under both int4 modes: at
    int4 it cost most of the quality (``bench/quantization_bench.py`` measures it), at int8 about
    the speed of int4 with two threads."""
    groups = groups or {}
    applied = resolve_mode(mode, model, groups)
    if applied == "none":
        return applied
    if model.device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs on the CPU only; this model is on {model.device}")
    dtype = model.dtype
    for module_name, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, Linear) or child is model.lm_head:
                continue
            if applied == "int8":
                setattr(module, name, Int8Linear(child.weight, child.bias, dtype))
                continue
            exact = _checkpoint_groups(groups, module_name, name, child)
            if exact is not None or mode == "int4":
                setattr(module, name, Int4Linear(child.weight, child.bias, dtype, exact))
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.head = Int8Linear(head, None, dtype)
    model.lm_head = None  # the head module replaces it; a tied embedding keeps its own rows for lookups
    return applied
