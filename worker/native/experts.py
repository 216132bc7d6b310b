"""Mixture-of-experts MLPs (Qwen3-MoE): a softmax router picks each token's ``top_k`` experts, and
the token's output is their SwiGLU outputs summed with the router's weights.

Both forwards group a step's tokens by expert, so an expert's weights are read once per step for
every token routed to it, and experts no token chose are not read at all.

- ``SparseMoe`` is the library forward, computed as transformers' ``Qwen3MoeSparseMoeBlock``
  computes it (fp32 logits agree to rounding; tests/worker/test_native_decoder.py).
- ``ExactExperts`` is the forward of ``--deterministic on``: router and experts on the exact
  kernels (``exact.py``), whose results for a row do not depend on the other rows of the call. So
  which other tokens chose the same expert, and how many, cannot change a token's bits. The
  router's softmax uses the kernels' fixed-order exp and sums; the choice is a stable sort (equal
  probabilities: the lower expert index first); the chosen weights are renormalised and the
  experts' outputs summed in rank order, in fp32, one element-wise operation at a time, and the
  residual is added before the one rounding to the activations' dtype.
"""

from __future__ import annotations

from typing import NamedTuple

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


def route_exact(logits: torch.Tensor, moe: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits ``[tokens, experts]`` → each token's expert weights and numbers
    ``[tokens, top_k]``, in rank order; every operation is a function of the token's row alone."""
    unnormalised = exact.exp_shifted(logits)
    probs = unnormalised / exact.block_sums(unnormalised, moe.num_experts)
    ordered = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, index = ordered.values[:, : moe.top_k], ordered.indices[:, : moe.top_k]
    if moe.norm_topk_prob:
        total = weights[:, 0]
        for rank in range(1, moe.top_k):
            total = total + weights[:, rank]
        weights = weights / total[:, None]
    return weights, index


class ExactExperts(NamedTuple):
    """A sparse layer on the exact kernels; the post-attention RMSNorm is fused into the router's
    and each expert's input quantization, the SwiGLU product into each down projection's."""

    moe: MoeSpec
    router: exact.ExactLinear  # fp32 logits
    gate_up: tuple[exact.ExactLinear, ...]  # one per expert
    down: tuple[exact.ExactLinear, ...]  # one per expert, fp32 out

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (not yet normalised) plus the experts' weighted sum."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        weights, index = route_exact(self.router(flat), self.moe)
        # The (token, rank) routes sorted by expert: one gather, then each expert's rows are one
        # contiguous slice, and one scatter puts the outputs back in (token, rank) order.
        routes = index.reshape(-1)
        order = torch.argsort(routes, stable=True)
        gathered = flat[order // self.moe.top_k]
        by_expert = torch.empty((routes.shape[0], flat.shape[-1]), dtype=torch.float32)
        start = 0
        for expert, count in enumerate(torch.bincount(routes, minlength=self.moe.num_experts).tolist()):
            if count:
                rows = gathered[start : start + count]
                by_expert[start : start + count] = self.down[expert](self.gate_up[expert](rows))
                start += count
        outputs = torch.empty_like(by_expert)
        outputs[order] = by_expert
        outputs = outputs.view(*index.shape, flat.shape[-1])
        total = outputs[:, 0] * weights[:, :1]
        for rank in range(1, self.moe.top_k):
            total = total + outputs[:, rank] * weights[:, rank : rank + 1]
        return (flat.float() + total).to(hidden.dtype).view_as(hidden)
