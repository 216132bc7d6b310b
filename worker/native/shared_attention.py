"""Attention for rows that read a shared prompt prefix before their own keys (cascade attention).

A prefix many sequences share is held once (``worker/engine/shared_prefix.py``); each row's own
slot holds only the positions after it. A row's attention is then two softmaxes over disjoint
key sets, joined exactly by their log-sum-exps: ``out = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2)``.
The rows of one prefix attend to it together, as one query block against one key block, so the
prefix is read once per step instead of once per row.

Grouped-query heads are laid out as query rows against their shared kv head
(``[rows, kv_heads, group * query_len, dim]``), so keys and values are never repeated.
"""

from __future__ import annotations

import torch


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp per query (fp32). ``mask`` is boolean, True where a
    query may attend, broadcastable to ``[batch, heads, queries, keys]``."""
    if query.device.type == "cpu":
        additive = None
        if mask is not None:
            additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
            additive.masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=additive, scale=scale
        )
        return out, lse
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), value.float())
    return out.to(query.dtype), lse


def merge(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor) -> torch.Tensor:
    """Join two attentions of the same queries over disjoint keys (``[..., queries, dim]``)."""
    top = torch.maximum(lse, other_lse)
    weight, other_weight = torch.exp(lse - top)[..., None], torch.exp(other_lse - top)[..., None]
    joined = (out.float() * weight + other.float() * other_weight) / (weight + other_weight)
    return joined.to(out.dtype)


def attend_with_prefixes(
    grouped_query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    prefixes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """``grouped_query`` ``[rows, kv_heads, group * query_len, dim]`` against each row's own
    ``key``/``value`` (``mask`` hides positions a row does not hold), joined with the prefix
    ``(rows, prefix_key, prefix_value)`` its rows share (``[kv_heads, length, dim]``)."""
    out, lse = attention_with_lse(grouped_query, key, value, mask, scale)
    for rows, prefix_key, prefix_value in prefixes:
        queries = grouped_query[rows]  # [n, kv_heads, q, dim]
        num_rows, kv_heads, num_queries, dim = queries.shape
        # All rows of the prefix as one query block: [1, kv_heads, n * q, dim].
        block = queries.transpose(0, 1).reshape(1, kv_heads, num_rows * num_queries, dim)
        shared, shared_lse = attention_with_lse(block, prefix_key[None], prefix_value[None], None, scale)
        shared = shared.reshape(kv_heads, num_rows, num_queries, dim).transpose(0, 1)
        shared_lse = shared_lse.reshape(kv_heads, num_rows, num_queries).transpose(0, 1)
        out[rows] = merge(out[rows], lse[rows], shared, shared_lse)
    return out
