"""Mixture-of-experts MLPs (Qwen3-MoE): a softmax router picks each token's ``top_k`` experts, and
the token's output is their SwiGLU outputs summed with the router's weights.

Both forwards group a step's tokens by expert, so an expert's weights are read once per step for
every token routed to it, and experts no token chose are not read at all.

- ``SparseMoe`` is the library forward, computed as transformers' ``Qwen3MoeSparseMoeBlock``
  computes it (fp32 logits agree to rounding; tests/worker/test_native_decoder.py).
- ``ExactExperts`` is the forward of ``--deterministic on``: router and experts in one call of
  the exact kernels (``exact.experts``), whose results for a row do not depend on the other rows
  of the call. So which other tokens chose the same expert, and how many, cannot change a token's
  bits. The router's softmax uses the kernels' fixed-order exp and sums; the choice is a stable
  sort (equal probabilities: the lower expert index first); the chosen weights are renormalised
  and the experts' outputs summed in rank order, in fp32, one element-wise operation at a time,
  and the residual is added before the one rounding to the activations' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from worker.native import exact
from worker.native.spec import DecoderSpec, MoeSpec


class Router(nn.Module):
    """``mlp.gate``: one logit per expert. Its own type (not a ``Linear``), so the library
    quantizer leaves it in the serving dtype: routing is where a small error changes the choice."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class Experts(nn.Module):
    """``mlp.experts``: every expert's gate and up projections as one ``[experts, 2 * inter,
    hidden]`` weight (gate rows first), and its down projection ``[experts, hidden, inter]``:
    transformers' layout, which the loader stacks published per-expert checkpoints into."""

    def __init__(self, moe: MoeSpec, hidden_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, moe.intermediate_size))


def _by_expert(index: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each chosen expert in ascending order: its number and the (token, rank) pairs that chose it."""
    groups = []
    for expert in torch.unique(index).tolist():
        token, rank = torch.where(index == expert)
        groups.append((int(expert), token, rank))
    return groups


class SparseMoe(nn.Module):
    """The library forward; ``hidden`` is the post-attention-normalised input."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        assert spec.moe is not None
        self.moe = spec.moe
        self.gate = Router(spec.hidden_size, spec.moe.num_experts)
        self.experts = Experts(spec.moe, spec.hidden_size)

    def join_projections(self) -> None:
        """Already joined: the experts' gate and up projections are one weight."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = F.linear(flat, self.gate.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        out = torch.zeros_like(flat)
        for expert, token, rank in _by_expert(index):
            gate, up = F.linear(flat[token], self.experts.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, self.experts.down_proj[expert])
            out.index_add_(0, token, expert_out * weights[token, rank, None])
        return out.view_as(hidden)


class ExactExperts(NamedTuple):
    """A sparse layer on the exact kernels, one kernel call per step (``exact.experts``): the
    post-attention RMSNorm is fused into the activations' quantization, the SwiGLU product into
    each down projection's. Build it with ``build``."""

    moe: MoeSpec
    router: exact.PackedWeight  # [experts, hidden]
    gate_up: tuple[exact.PackedWeight, ...]  # one per expert, [2 * inter, hidden]
    down: tuple[exact.PackedWeight, ...]  # one per expert, [hidden, inter]
    kernel: Any  # the kernel's object holding all of them and the norm

    @classmethod
    def build(
        cls, moe: MoeSpec, router: exact.PackedWeight, gate_up: Sequence[exact.PackedWeight],
        down: Sequence[exact.PackedWeight], norm_weight: torch.Tensor, eps: float,
    ) -> ExactExperts:  # fmt: skip
        kernel = exact.experts_kernel(router, gate_up, down, norm_weight, eps, moe.top_k, moe.norm_topk_prob)
        return cls(moe, router, tuple(gate_up), tuple(down), kernel)

    def __call__(self, hidden: torch.Tensor, *, scalar: bool = False, portable: bool = False) -> torch.Tensor:
        """``hidden`` (not yet normalised) plus the experts' weighted sum."""
        out, _ = exact.experts(self.kernel, hidden, scalar=scalar, portable=portable)
        return out
