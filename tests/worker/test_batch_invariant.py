"""The kernel facts ``worker/native/batch_invariant.py`` rests on, checked on this torch build
(bf16 on the CPU): if an upgrade changes them, these fail before any text does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.native import batch_invariant

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


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (16, 8, 128), (4, 4, 64)])
def test_attention_bits_are_the_same_decoding_alone_padded_and_in_any_prefill_chunk(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(0)
    group, scale, length = heads // kv_heads, head_dim**-0.5, 700
    query = torch.randn(1, heads, length, head_dim).to(torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, length, head_dim).to(torch.bfloat16) for _ in range(2))

    def decode(position: int, keys: int) -> torch.Tensor:
        """One query row against ``keys`` keys, those past ``position`` masked (a shorter row in a batch)."""
        grouped = query[:, :, position : position + 1].reshape(1, kv_heads, group, head_dim)
        mask = None if keys == position + 1 else (torch.arange(keys) <= position)[None, None, None, :]
        out = batch_invariant.attention(grouped, key[:, :, :keys], value[:, :, :keys], mask, scale)
        return out.reshape(heads, head_dim)

    def prefill(start: int, end: int, position: int) -> torch.Tensor:
        """Queries ``[start, end)`` of a prompt chunk, causally masked; the row of ``position``."""
        grouped = query[:, :, start:end].reshape(1, kv_heads, group * (end - start), head_dim)
        causal = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        mask = causal[None, None].repeat(1, 1, group, 1)
        out = batch_invariant.attention(grouped, key[:, :, :end], value[:, :, :end], mask, scale)
        return out.reshape(heads, end - start, head_dim)[:, position - start]

    for position in [0, 1, 31, 32, 33, 255, 256, 511, 512, 600]:
        alone = decode(position, position + 1)
        for keys in (position + 2, position + 17, length):
            if keys <= length:
                assert torch.equal(decode(position, keys), alone), (position, keys)
        for start in (0, max(0, position - 40), position):
            for end in (position + 1, min(length, position + 9), min(length, position + 300)):
                assert torch.equal(prefill(start, end, position), alone), (position, start, end)
