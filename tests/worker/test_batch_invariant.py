"""The kernel facts ``worker/native/batch_invariant.py`` rests on, checked on this torch build
(bf16 on the CPU): if an upgrade changes them, these fail before any text does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.native import batch_invariant
from worker.native.batch_invariant import KEY_BLOCK

# SmolLM2-135M's matmuls (q/k/v joined, gate/up joined, down, head) and a Qwen3-0.6B-like one.
SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576), (2048, 1024)]


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_a_rows_matmul_bits_do_not_depend_on_the_rows_beside_it(out_features: int, in_features: int) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
    x = torch.randn(70, in_features).to(torch.bfloat16)
    every_row = F.linear(x, weight)
    alone = torch.cat([batch_invariant.linear(x[i : i + 1], weight, None) for i in range(len(x))])
    assert torch.equal(alone, every_row)
    for start, count in [(0, 2), (5, 3), (9, 17), (31, 39)]:
        assert torch.equal(
            batch_invariant.linear(x[start : start + count], weight, None), every_row[start : start + count]
        )


def test_one_row_through_f_linear_can_differ_which_is_why_it_is_computed_as_two() -> None:
    """The fact that makes ``batch_invariant.linear`` necessary (oneDNN's one-row kernel)."""
    torch.manual_seed(0)
    weight = (torch.randn(576, 1536) * 0.05).to(torch.bfloat16)
    x = torch.randn(600, 1536).to(torch.bfloat16)
    one_by_one = torch.cat([F.linear(x[i : i + 1], weight) for i in range(len(x))])
    assert not torch.equal(one_by_one, F.linear(x, weight))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 64), (16, 8, 128), (16, 4, 128)]
)
def test_attention_bits_are_the_same_decoding_alone_padded_and_in_any_prefill_chunk(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """SmolLM2's, Qwen2.5-0.5B's, a multi-head and two Qwen3 shapes: a query's attention alone,
    beside longer rows, and at any place of any prefill chunk."""
    torch.manual_seed(0)
    group, scale, length = heads // kv_heads, head_dim**-0.5, 1400
    query = torch.randn(1, heads, length, head_dim).to(torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, length + KEY_BLOCK, head_dim).to(torch.bfloat16) for _ in range(2))

    def attend(queries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """As the runner calls it: keys read in whole blocks past the rows' lengths, masked."""
        keys = -(-mask.shape[-1] // KEY_BLOCK) * KEY_BLOCK
        padded = torch.zeros(*mask.shape[:-1], keys, dtype=torch.bool)
        padded[..., : mask.shape[-1]] = mask
        additive = batch_invariant.additive_mask(padded, group, torch.bfloat16)
        return batch_invariant.attention(queries, key[:, :, :keys], value[:, :, :keys], additive, scale)

    def decode(position: int, keys: int) -> torch.Tensor:
        """One query row against ``keys`` keys, those past ``position`` masked (a shorter row in a batch)."""
        grouped = query[:, :, position : position + 1].reshape(1, kv_heads, group, head_dim)
        return attend(grouped, (torch.arange(keys) <= position)[None, None, None, :]).reshape(heads, head_dim)

    def prefill(start: int, end: int, position: int) -> torch.Tensor:
        """Queries ``[start, end)`` of a prompt chunk, causally masked; the row of ``position``."""
        grouped = query[:, :, start:end].reshape(1, kv_heads, group * (end - start), head_dim)
        causal = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        return attend(grouped, causal[None, None]).reshape(heads, end - start, head_dim)[:, position - start]

    for position in [0, 1, 31, 100, 511, 512, 600, 1100]:
        alone = decode(position, position + 1)
        for keys in (position + 2, position + 17, length):
            if keys <= length:
                assert torch.equal(decode(position, keys), alone), (position, keys)
        for start in (0, max(0, position - 40), max(0, position - 3), position):
            for end in (position + 1, position + 2, position + 9, position + 100, position + 300):
                if end <= length:
                    assert torch.equal(prefill(start, end, position), alone), (position, start, end)


def test_the_padding_is_what_makes_flash_attention_invariant() -> None:
    """Without whole key blocks and padded query rows, torch's flash attention gives a decode
    step other bits than a prefill chunk (the facts the padding exists for)."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, length = 16, 8, 128, 700
    group = heads // kv_heads
    query = torch.randn(1, heads, length, head_dim).to(torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, length, head_dim).to(torch.bfloat16) for _ in range(2))
    differ = 0
    for position in range(300, 340):
        grouped = query[:, :, position : position + 1].reshape(1, kv_heads, group, head_dim)
        alone = F.scaled_dot_product_attention(grouped, key[:, :, : position + 1], value[:, :, : position + 1])
        chunk = query[:, :, 280 : position + 1].repeat_interleave(1, dim=1)
        causal = torch.arange(position + 1)[None, :] <= torch.arange(280, position + 1)[:, None]
        in_chunk = F.scaled_dot_product_attention(
            chunk, key[:, :, : position + 1].repeat_interleave(group, 1),
            value[:, :, : position + 1].repeat_interleave(group, 1), attn_mask=causal,
        )[:, :, -1]  # fmt: skip
        differ += not torch.equal(alone.reshape(heads, head_dim), in_chunk.reshape(heads, head_dim))
    assert differ > 0
