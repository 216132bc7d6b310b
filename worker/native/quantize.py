"""Packed int8 / int4 weights for the native decoder's small decode batches on CPU
(``--quantization int8|int4``).

A decode step of a few rows reads every weight once and does little else with it: there the
read is the cost, and int8 weights halve the bytes of bf16 ones (int4: a quarter). Activations
stay in the serving dtype, and torch's packed kernels (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``) multiply without writing a dequantized copy. They loop over
rows, though: from ~5 rows on oneDNN's bf16 GEMM is faster, so matmuls of more than
``PACKED_MAX_ROWS`` rows (prefill chunks, busy batches) keep using the serving-dtype weights
(``bench/packed_matmul_bench.py`` times both). The cost is memory: the packed copy comes on top.

FBGEMM's dynamic int8 (inputs quantized per tensor) is not offered: slower than int4 for one
stream, and its greedy text departs soonest (``bench/quantization_bench.py`` measures it). The token embedding
is a lookup and stays as it is; the LM head gets its own packed copy.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker.native.decoder import Linear, NativeCausalLM

Quantization = Literal["none", "int8", "int4"]
INT4_GROUP = 32
# The crossover bench/packed_matmul_bench.py measures on SmolLM2's shapes: at 4 rows the packed
# kernels still win, at 8 they lose.
PACKED_MAX_ROWS = 4


class _SmallBatchLinear(nn.Module):
    """``y = x W^T (+ b)``: a packed low-bit weight for up to ``PACKED_MAX_ROWS`` input rows, the
    serving-dtype weight for more."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Buffer(weight.detach().to(dtype))
        self.bias = None if bias is None else nn.Buffer(bias.detach().to(dtype))

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > PACKED_MAX_ROWS:
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
    """4-bit values in groups of ``INT4_GROUP`` inputs, each group with its own scale and minimum
    (llama.cpp's Q4_1 scheme), packed for torch's CPU kernel (``aten._weight_int4pack_mm_for_cpu``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight, bias, dtype)
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP:
            raise ValueError(f"int4 needs input widths that are multiples of {INT4_GROUP}, not {in_features}")
        groups = weight.detach().float().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
        values = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        self.packed = nn.Buffer(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.reshape(out_features, in_features), 1)
        )
        # The kernel computes (q - 8) * scale + zero: zero = low + 8 * scale gives q * scale + low.
        zeros = low + 8 * scales
        self.scales_and_zeros = nn.Buffer(torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype))

    def _packed_mm(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scales_and_zeros)


def quantize(model: NativeCausalLM, mode: Quantization) -> NativeCausalLM:
    """Replace the decoder's matmuls in place (no-op for ``none``); returns the model."""
    if mode == "none":
        return model
    if model.device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs on the CPU only; this model is on {model.device}")
    dtype = model.dtype
    kind = Int8Linear if mode == "int8" else Int4Linear
    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, kind(child.weight, child.bias, dtype))
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.head = kind(head, None, dtype)
    model.lm_head = None  # the head module replaces it; a tied embedding keeps its own rows for lookups
    return model
