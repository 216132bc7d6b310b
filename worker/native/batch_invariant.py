"""Batch-invariant matmul and attention for the native decoder (``--deterministic on``): a row's
result is the same bits whatever other rows share the call, however its prompt was chunked,
and whether its keys came from the prefix cache or were computed in this step.

What holds on the CPU in bf16, and what does not (``tests/worker/test_batch_invariant.py``
checks each of these on torch's own kernels):

- oneDNN's bf16 GEMM gives every row the same bits for any number of rows from 2 up, and a
  product over keys the same bits when the keys are padded with zeros. One row alone takes
  another kernel (for a 1536-wide input, 6 rows in 600 differ), so a single row is computed
  as two.
- fp32 GEMMs (MKL) differ with the row count, and torch's flash attention differs with the
  query block and with how far the keys are padded. Attention here is therefore written as
  two bf16 GEMMs around an fp32 softmax, as transformers' eager attention computes it (scores
  rounded to bf16 before the softmax), over the row's keys padded to the longest row's.
- The packed int4 / int8 kernels are row-invariant too, but give other bits than the bf16
  GEMM: a model uses one or the other for every row count, never both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with a single input row computed as two (see the module docstring)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] != 1:
        return F.linear(x, weight, bias)
    return F.linear(flat.expand(2, -1).contiguous(), weight, bias)[:1].view(*x.shape[:-1], -1)


def attention(
    grouped_query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``grouped_query`` ``[rows, kv_heads, queries, dim]`` (a kv head's query heads, and their
    positions, as query rows) against ``key``/``value`` ``[rows, kv_heads, keys, dim]``; ``mask``
    is boolean, True where a query may attend, broadcastable to ``[rows, 1, queries, keys]``."""
    # Keys read from the slot cache are a strided view (a slot spans --max-model-len positions):
    # copied first, the product takes a quarter of the time it takes on the view (same bits).
    scores = torch.matmul(grouped_query, key.contiguous().transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value)
