"""Batch-invariant matmul and attention for the native decoder (``--deterministic on``): a row's
result is the same bits whatever other rows share the call, however its prompt was chunked,
and whether its keys came from the prefix cache or were computed in this step.

What holds on the CPU in bf16, and what does not (``tests/worker/test_batch_invariant.py``
checks each of these on torch's own kernels):

- oneDNN's bf16 GEMM gives every row the same bits for any number of rows from 2 up. One row
  alone takes another kernel (for a 1536-wide input, 6 rows in 600 differ), so a single row is
  computed as two. fp32 GEMMs (MKL) differ with the row count.
- torch's CPU flash attention gives a query the same bits in any call when two things hold:
  the keys' count is a multiple of ``KEY_BLOCK`` (its reductions then never reach a scalar tail;
  the caller reads keys past the rows' lengths, masked), and none of its query blocks has fewer
  than ``MIN_QUERY_ROWS`` rows (small blocks take another GEMM kernel), which the query rows are
  padded for. Without them most decode-against-prefill positions differed.
- The packed int4 / int8 kernels are row-invariant too, but give other bits than the bf16
  GEMM: a model uses one or the other for every row count, never both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_BLOCK = 64  # a multiple of every vector width the kernels use
MIN_QUERY_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with a single input row computed as two (see the module docstring)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] != 1:
        return F.linear(x, weight, bias)
    return F.linear(flat.expand(2, -1).contiguous(), weight, bias)[:1].view(*x.shape[:-1], -1)


def _query_block(num_rows: int) -> int:
    """The query block torch's CPU flash attention splits ``num_rows`` query rows into."""
    return 256 if num_rows >= 768 else 64 if num_rows >= 192 else 32


def padded_query_rows(num_rows: int) -> int:
    """Query rows to compute so that no query block has fewer than ``MIN_QUERY_ROWS`` rows."""
    rows = max(num_rows, MIN_QUERY_ROWS)
    tail = rows % _query_block(rows)
    return rows + MIN_QUERY_ROWS - tail if 0 < tail < MIN_QUERY_ROWS else rows


def additive_mask(mask: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The boolean ``[rows, 1, queries, keys]`` mask of a step as the attention below takes it:
    a kv head's query heads as query rows (each repeating the queries' mask), padded like the
    query rows, 0 where a query may attend and -inf elsewhere. Built once per forward."""
    queries = mask.shape[2]
    if queries > 1 and group_size > 1:
        mask = mask.repeat(1, 1, group_size, 1)
    rows = mask.shape[2]
    if queries > 1 and padded_query_rows(rows) > rows:
        mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, padded_query_rows(rows) - rows, -1)], dim=2)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention(
    grouped_query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``grouped_query`` ``[rows, kv_heads, queries, dim]`` (a kv head's query heads, and their
    positions, as query rows) against ``key``/``value`` ``[rows, kv_heads, keys, dim]``, ``keys`` a
    multiple of ``KEY_BLOCK``; ``mask`` from ``additive_mask``."""
    num_rows = grouped_query.shape[2]
    padded = padded_query_rows(num_rows)
    if padded > num_rows:  # repeats of the last row, whose results are dropped
        grouped_query = torch.cat([grouped_query, grouped_query[:, :, -1:].expand(-1, -1, padded - num_rows, -1)], 2)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        grouped_query.contiguous(), key, value, 0.0, False, attn_mask=mask, scale=scale
    )
    return out[:, :, :num_rows]
