"""Mixture-of-experts layers (``worker/native/experts.py``): the exact forward routes and sums a
token the same whatever else shares its step, on the vector and the portable kernel code alike,
and computes what the library forward computes (to the 8-bit weights' error)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch

from tests.support.qwen import tiny_random_qwen3_moe_dir
from worker.native import exact
from worker.native.decoder import NativeCausalLM
from worker.native.deterministic import ExactSummary, _exact_mlp
from worker.native.experts import ExactExperts, SparseMoe, route_exact
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


def test_routing_breaks_ties_by_expert_number_and_renormalises() -> None:
    moe = MoeSpec(num_experts=6, top_k=3, intermediate_size=8, norm_topk_prob=True, sparse_layers=frozenset({0}))
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.5], [3.0, 1.0, 1.0, 1.0, 0.0, 1.0]])
    weights, index = route_exact(logits, moe)
    assert index.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))
    reference = torch.softmax(logits, dim=-1).gather(1, index)
    torch.testing.assert_close(weights, reference / reference.sum(dim=-1, keepdim=True))


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


def test_the_vector_and_the_portable_kernel_code_give_the_same_bits(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    *_, parts = _layer(folder)
    hidden = torch.randn(1, 19, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    vector = parts(hidden)
    for name in ("matmul", "exp_shifted", "block_sums"):
        monkeypatch.setattr(exact, name, functools.partial(getattr(exact, name), scalar=True))
    assert torch.equal(parts(hidden), vector)


def test_the_exact_experts_compute_what_the_library_forward_computes(folder: Path) -> None:
    # A router far from ties, so 8-bit weights do not change which experts a token gets.
    library, norm_weight, eps, parts = _layer(folder, router_scale=200.0)
    hidden = torch.randn(1, 23, 64, generator=torch.Generator().manual_seed(2))
    normed = norm_weight * torch.nn.functional.rms_norm(hidden, (64,), None, eps)
    with torch.no_grad():
        expected = library(normed)
    got = parts(hidden) - hidden
    assert (got - expected).norm() / expected.norm() < 0.05
