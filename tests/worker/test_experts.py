"""Mixture-of-experts layers (``worker/native/experts.py``): the exact forward's one kernel call
gives the bits of the one-projection kernels composed, routes and sums a token the same whatever
else shares its step, on the vector and the portable kernel code alike, and computes what the
library forward computes (to the 8-bit weights' error)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.qwen import tiny_random_qwen3_moe_dir
from worker.native import exact
from worker.native.decoder import NativeCausalLM
from worker.native.deterministic import ExactSummary, _exact_mlp
from worker.native.experts import ExactExperts, SparseMoe
from worker.native.loader import load_native
from worker.native.spec import MoeSpec, read_decoder_spec

pytestmark = pytest.mark.skipif(not exact.available(), reason="the exact kernels need a C++ compiler")


@pytest.fixture(scope="module")
def folder() -> Path:
    return tiny_random_qwen3_moe_dir()


def _layer(folder: Path, router_scale: float = 1.0) -> tuple[SparseMoe, torch.Tensor, float, ExactExperts]:
    """Layer 0's experts: the library module (fp32), its norm, and the same on the exact kernels."""
    model: NativeCausalLM = load_native(read_decoder_spec(folder), torch.float32, torch.device("cpu"))
    layer = model.model.decoder_layers()[0]
    moe = layer.mlp
    assert isinstance(moe, SparseMoe)
    with torch.no_grad():
        moe.gate.weight.mul_(router_scale)
    library = copy.deepcopy(moe)
    parts = _exact_mlp(moe, "model.layers.0.mlp", layer.post_attention_layernorm, {}, "auto", ExactSummary())
    assert isinstance(parts, ExactExperts)
    return library, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, parts


def _composed(
    parts: ExactExperts, norm_weight: torch.Tensor, eps: float, hidden: torch.Tensor, scalar: bool = False,
    portable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The layer as the one-projection kernels compute it: the router, its softmax from the
    fixed-order exp and sums, a stable sort, each token's experts one matmul at a time, and the
    weighted sum in rank order in fp32, rounded once with the residual."""
    paths = {"scalar": scalar, "portable": portable}
    moe, flat = parts.moe, hidden.reshape(-1, hidden.shape[-1])
    logits = exact.matmul(flat, parts.router, prologue=exact.PROLOGUE_RMS_NORM, norm_weight=norm_weight, eps=eps,
                          out_float32=True, **paths)  # fmt: skip
    unnormalised = exact.exp_shifted(logits, scalar=scalar or portable)
    probs = unnormalised / exact.block_sums(unnormalised, moe.num_experts, scalar=scalar or portable)
    ordered = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, index = ordered.values[:, : moe.top_k], ordered.indices[:, : moe.top_k]
    if moe.norm_topk_prob:
        total = weights[:, 0]
        for rank in range(1, moe.top_k):
            total = total + weights[:, rank]
        weights = weights / total[:, None]
    outputs = torch.empty(flat.shape[0], moe.top_k, flat.shape[1])
    for token in range(flat.shape[0]):
        for rank in range(moe.top_k):
            expert = int(index[token, rank])
            gate_up = exact.matmul(flat[token : token + 1], parts.gate_up[expert], prologue=exact.PROLOGUE_RMS_NORM,
                                   norm_weight=norm_weight, eps=eps, **paths)  # fmt: skip
            outputs[token, rank] = exact.matmul(gate_up, parts.down[expert], prologue=exact.PROLOGUE_SILU_MUL,
                                                out_float32=True, **paths)[0]  # fmt: skip
    total = outputs[:, 0] * weights[:, :1]
    for rank in range(1, moe.top_k):
        total = total + outputs[:, rank] * weights[:, rank : rank + 1]
    return (flat.float() + total).to(hidden.dtype).view_as(hidden), index


def _random_layer(
    seed: int, experts: int, top_k: int, norm_topk_prob: bool, factored: bool
) -> tuple[ExactExperts, torch.Tensor]:
    """A layer of random packed weights: 4-bit with a GGUF Q4_K's factored scales (widths of 256),
    or 8-bit (widths of 64 and 32)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = (256, 256) if factored else (64, 32)

    def weight(out: int, width: int) -> exact.PackedWeight:
        if not factored:
            return exact.pack_int8(torch.randn(out, width, generator=generator) / width**0.5)
        values = torch.randint(0, 16, (out, width), generator=generator, dtype=torch.uint8)
        d = torch.rand(out, width // 256, generator=generator) * 0.01
        neg_dmin = -torch.rand(out, width // 256, generator=generator) * 0.01
        sc = torch.randint(0, 64, (out, width // 32), generator=generator, dtype=torch.uint8)
        m = torch.randint(0, 64, (out, width // 32), generator=generator, dtype=torch.uint8)
        return exact.pack_int4_factored(values, d, sc, neg_dmin, m)

    moe = MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=inter, norm_topk_prob=norm_topk_prob,
                  sparse_layers=frozenset({0}))  # fmt: skip
    norm_weight = (1 + torch.randn(hidden, generator=generator) / 4).to(torch.bfloat16)
    router = exact.pack_int8(torch.randn(experts, hidden, generator=generator))
    gate_up = [weight(2 * inter, hidden) for _ in range(experts)]
    down = [weight(hidden, inter) for _ in range(experts)]
    return ExactExperts.build(moe, router, gate_up, down, norm_weight, 1e-6), norm_weight


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    experts=st.integers(1, 20),
    top_k_share=st.floats(0, 1),
    norm_topk_prob=st.booleans(),
    factored=st.booleans(),
    tokens=st.integers(1, 9),
    bf16=st.booleans(),
    path=st.sampled_from(["vector", "scalar", "portable"]),
)
def test_the_one_call_gives_the_bits_of_the_one_projection_kernels_composed(
    seed: int, experts: int, top_k_share: float, norm_topk_prob: bool, factored: bool, tokens: int, bf16: bool,
    path: str,
) -> None:  # fmt: skip
    top_k = 1 + round(top_k_share * (experts - 1))
    parts, norm_weight = _random_layer(seed, experts, top_k, norm_topk_prob, factored)
    width = parts.router.in_features
    hidden = torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed + 1))
    hidden = hidden.to(torch.bfloat16 if bf16 else torch.float32)
    paths = {"scalar": path == "scalar", "portable": path == "portable"}
    out, index = exact.experts(parts.kernel, hidden, **paths)
    expected, expected_index = _composed(parts, norm_weight, 1e-6, hidden, **paths)
    assert torch.equal(index, expected_index)
    assert out.dtype == hidden.dtype and torch.equal(out, expected)


def test_routing_breaks_ties_by_expert_number() -> None:
    parts, _ = _random_layer(0, experts=6, top_k=3, norm_topk_prob=True, factored=False)
    # Experts 1, 2 and 4 have one router row, the rest its negation: three equal logits on top.
    row = torch.randn(parts.router.in_features, generator=torch.Generator().manual_seed(3))
    signs = torch.tensor([-1.0, 1.0, 1.0, -1.0, 1.0, -1.0])
    router = exact.pack_int8(signs[:, None] * row)
    tied = ExactExperts.build(parts.moe, router, parts.gate_up, parts.down, torch.ones(row.shape[0]), 1e-6)
    hidden = torch.cat([row[None], -row[None]])  # the second token: 0, 3 and 5 tie on top
    _, index = exact.experts(tied.kernel, hidden)
    assert index.tolist() == [[1, 2, 4], [0, 3, 5]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_token_gets_the_same_bits_alone_and_among_any_other_tokens(folder: Path, dtype: torch.dtype) -> None:
    *_, parts = _layer(folder)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 64, generator=generator).to(dtype)
    together = parts(hidden[None])[0]
    for row in range(hidden.shape[0]):
        assert torch.equal(parts(hidden[row : row + 1][None])[0, 0], together[row]), f"row {row}"
    # A different crowd: the rows reversed and repeated, chunked unevenly.
    crowd = torch.cat([hidden.flip(0), hidden[:5]])
    again = torch.cat([parts(chunk[None])[0] for chunk in crowd.split([11, 1, 30])])
    assert torch.equal(again[: hidden.shape[0]].flip(0), together)


def test_the_vector_and_the_portable_kernel_code_give_the_same_bits(folder: Path) -> None:
    *_, parts = _layer(folder)
    hidden = torch.randn(1, 19, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    vector = parts(hidden)
    assert torch.equal(parts(hidden, scalar=True), vector)
    assert torch.equal(parts(hidden, portable=True), vector)


def test_the_exact_experts_compute_what_the_library_forward_computes(folder: Path) -> None:
    # A router far from ties, so 8-bit weights do not change which experts a token gets.
    library, norm_weight, eps, parts = _layer(folder, router_scale=200.0)
    hidden = torch.randn(1, 23, 64, generator=torch.Generator().manual_seed(2))
    normed = norm_weight * torch.nn.functional.rms_norm(hidden, (64,), None, eps)
    with torch.no_grad():
        expected = library(normed)
    got = parts(hidden) - hidden
    assert (got - expected).norm() / expected.norm() < 0.05
