"""The Llama-family decoder (RMSNorm, RoPE, grouped-query attention over SDPA, SwiGLU), with
parameter names equal to the checkpoints', so a safetensors state dict loads as it is.

It computes what transformers' implementation computes, operation for operation (fp32 logits
agree to rounding; tests/worker/test_native_decoder.py holds it to that), but only the engine's
step: token ids, positions and an explicit mask in, hidden states out, keys and values written
through the slot cache (``kv_cache.py``).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.native import exact
from worker.native.experts import ExactExperts, SparseMoe
from worker.native.kv_cache import SharedGroup
from worker.native.lora import LoraStep
from worker.native.shared_attention import attend_with_prefixes
from worker.native.spec import DecoderSpec

logger = logging.getLogger(__name__)


class StepCache(Protocol):
    shared_groups: tuple[SharedGroup, ...]  # this step's rows that read a shared prefix first

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def shared_kv(self, layer_idx: int, group: SharedGroup) -> tuple[torch.Tensor, torch.Tensor]: ...


class Linear(nn.Module):
    """``nn.Linear`` without its random initialisation: weights are always assigned from the
    checkpoint, and initialising on the meta device pulls in torch's decomposition machinery
    (~2 s of imports)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def of(cls, weight: torch.Tensor) -> Linear:
        """A bias-free ``Linear`` around an existing weight (one expert's of a stacked weight)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = None
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class JoinedLinear(Linear):
    """Several projections of the same input as one matmul (q/k/v, gate/up): one weight read
    and one kernel call instead of two or three per layer and step. ``part_names`` are the
    checkpoint's names of the parts, in row order (the quantizer looks their groups up by them)."""

    def __init__(self, parts: dict[str, Linear]) -> None:
        first = next(iter(parts.values()))
        super().__init__(first.weight.shape[1], sum(p.weight.shape[0] for p in parts.values()), first.bias is not None)
        self.weight = nn.Parameter(torch.cat([p.weight for p in parts.values()]), requires_grad=False)
        if first.bias is not None:
            self.bias = nn.Parameter(torch.cat([p.bias for p in parts.values() if p.bias is not None]),
                                     requires_grad=False)  # fmt: skip
        self.part_names = tuple(parts)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # transformers' ``x * rsqrt(mean(x^2) + eps)`` in fp32, as one kernel (bit-identical, 4 ops fewer).
        normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), None, self.eps)
        return self.weight * normed.to(hidden.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers computes it, ``x * cos + rotate_half(x) * sin``, in four ops: the
    halves swapped by one roll, the sign of ``rotate_half`` carried by ``signed_sin``."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Deepstack(NamedTuple):
    """Vision features added to the hidden states of image positions after each of the first
    ``len(features)`` layers (Qwen3-VL's deepstack): ``features[i]`` ``[n, hidden]`` at
    ``(rows, cols)`` of the step."""

    rows: torch.Tensor
    cols: torch.Tensor
    features: list[torch.Tensor]


def _mrope_streams(section: tuple[int, ...], interleaved: bool, half_dim: int) -> torch.Tensor:
    """For each rotary half-dimension, the position stream (0 temporal, 1 height, 2 width) it
    rotates by: consecutive blocks of ``section`` (Qwen2-VL), or every third dimension from the
    first (height) and second (width) within three times their section, the rest temporal (Qwen3-VL)."""
    if sum(section) != half_dim:
        raise ValueError(f"mrope_section {section} does not cover {half_dim} rotary dimensions")
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
    streams = torch.zeros(half_dim, dtype=torch.long)
    for stream in (1, 2):
        streams[stream : section[stream] * 3 : 3] = stream
    return streams


class ExactMlp(NamedTuple):
    """A dense MLP on the exact kernels."""

    gate_up: exact.ExactLinear  # post_attention_layernorm fused
    down: exact.ExactLinear  # silu(gate) * up fused

    def __call__(self, hidden: torch.Tensor, lora: LoraStep | None = None, layer: int = 0) -> torch.Tensor:
        """``hidden`` (not yet normalised) plus the MLP's output."""
        if lora is None:
            return self.down(self.gate_up(hidden), residual=hidden)
        query_len = hidden.shape[1]
        gate_up = self.gate_up(hidden, lora=lora.rows(layer, "gate_up", query_len))
        return self.down(gate_up, residual=hidden, lora=lora.rows(layer, "down", query_len))


class ExactParts(NamedTuple):
    """A layer's matmuls on the exact kernels (``exact.py``, ``--deterministic on``), with the
    operations around them fused into their activations' quantization."""

    qkv: exact.ExactLinear  # input_layernorm fused
    o: exact.ExactLinear
    mlp: ExactMlp | ExactExperts


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = spec.head_dim
        self.num_kv_heads = spec.num_key_value_heads
        self.group_size = spec.num_attention_heads // spec.num_key_value_heads
        self.scale = spec.head_dim**-0.5
        q_width, kv_width = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
        self.q_proj = Linear(spec.hidden_size, q_width, bias=spec.qkv_bias)
        self.k_proj = Linear(spec.hidden_size, kv_width, bias=spec.qkv_bias)
        self.v_proj = Linear(spec.hidden_size, kv_width, bias=spec.qkv_bias)
        self.o_proj = Linear(q_width, spec.hidden_size, bias=spec.o_proj_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.num_heads = spec.num_attention_heads
        self.qkv_proj: Linear | None = None  # set by join_projections()

    def join_projections(self) -> None:
        self.qkv_proj = JoinedLinear({"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj})
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: StepCache,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        rows, query_len, _ = hidden.shape
        assert self.qkv_proj is not None, "join_projections() runs at load"
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            qkv = lora.add(self.layer_idx, "qkv", hidden, qkv)
        qkv = qkv.view(rows, query_len, -1, self.head_dim)
        query_and_key = qkv[:, :, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:
            query = self.q_norm(query_and_key[:, :, : self.num_heads])
            query_and_key = torch.cat((query, self.k_norm(query_and_key[:, :, self.num_heads :])), dim=2)
        cos, signed_sin = rope
        query_and_key = _rotate(query_and_key, cos, signed_sin).transpose(1, 2)
        query, key = query_and_key[:, : self.num_heads], query_and_key[:, self.num_heads :]
        value = qkv[:, :, self.num_heads + self.num_kv_heads :].transpose(1, 2)
        key, value = cache.update(key, value, self.layer_idx)
        if cache.shared_groups:
            out = self._attend_with_prefixes(query, key, value, mask, cache)
            return self._project(out.transpose(1, 2).reshape(rows, query_len, -1), lora)
        if rows == 1 and query_len == 1:
            mask = None  # one query at the last position sees every key: SDPA's unmasked path is cheaper
        if query_len == 1 and self.group_size > 1:
            # One query per row: the group's heads become query rows against their shared kv head,
            # so keys and values are read once per kv head instead of being repeated.
            grouped = query.reshape(rows, self.num_kv_heads, self.group_size, self.head_dim)
            out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=self.scale)
            out = out.reshape(rows, -1, 1, self.head_dim)
        else:
            if self.group_size > 1:
                key = key.repeat_interleave(self.group_size, dim=1)
                value = value.repeat_interleave(self.group_size, dim=1)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scale)
        return self._project(out.transpose(1, 2).reshape(rows, query_len, -1), lora)

    def _project(self, out: torch.Tensor, lora: LoraStep | None) -> torch.Tensor:
        projected: torch.Tensor = self.o_proj(out)
        return projected if lora is None else lora.add(self.layer_idx, "o", out, projected)

    def forward_exact(
        self,
        parts: ExactParts,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: StepCache,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """``hidden`` plus ``forward`` on the exact kernels (``hidden`` not yet normalised:
        ``parts.qkv`` does it; ``parts.o`` adds the residual): every query sees the keys of
        positions ``0..positions[row, t]`` of its row's slot."""
        assert not cache.shared_groups, "the deterministic forward reads prefixes copied into each slot"
        rows, query_len, _ = hidden.shape
        qkv = parts.qkv(hidden, lora=None if lora is None else lora.rows(self.layer_idx, "qkv", query_len))
        qkv = qkv.view(rows, query_len, -1, self.head_dim)
        query_and_key = qkv[:, :, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:
            query = exact.rms_norm(query_and_key[:, :, : self.num_heads], self.q_norm.weight, self.q_norm.eps)
            key = exact.rms_norm(query_and_key[:, :, self.num_heads :], self.k_norm.weight, self.k_norm.eps)
            query_and_key = torch.cat((query, key), dim=2)
        cos, signed_sin = rope
        query_and_key = _rotate(query_and_key, cos, signed_sin).transpose(1, 2)
        query, key = query_and_key[:, : self.num_heads], query_and_key[:, self.num_heads :]
        value = qkv[:, :, self.num_heads + self.num_kv_heads :].transpose(1, 2)
        key, value = cache.update(key, value, self.layer_idx)
        out = exact.attention(query, key, value, positions, self.scale).view(rows, query_len, -1)
        return parts.o(out, residual=hidden, lora=None if lora is None else lora.rows(self.layer_idx, "o", query_len))

    def _attend_with_prefixes(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        cache: StepCache,
    ) -> torch.Tensor:
        """Rows attached to shared prefixes (``shared_attention.py``); ``[rows, heads, q, dim]``."""
        rows, _, query_len, _ = query.shape
        # The group's heads (and each head's queries) become query rows of their kv head.
        grouped = query.reshape(rows, self.num_kv_heads, self.group_size * query_len, self.head_dim)
        if mask is not None and query_len > 1 and self.group_size > 1:
            mask = mask.repeat(1, 1, self.group_size, 1)
        prefixes = [(group.rows, *cache.shared_kv(self.layer_idx, group)) for group in cache.shared_groups]
        out = attend_with_prefixes(grouped, key, value, mask, self.scale, prefixes)
        return out.reshape(rows, self.num_heads, query_len, self.head_dim)


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.gate_proj = Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.up_proj = Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.gate_up_proj: Linear | None = None  # set by join_projections()

    def join_projections(self) -> None:
        self.gate_up_proj = JoinedLinear({"gate_proj": self.gate_proj, "up_proj": self.up_proj})
        del self.gate_proj, self.up_proj

    def forward(self, hidden: torch.Tensor, lora: LoraStep | None = None, layer: int = 0) -> torch.Tensor:
        assert self.gate_up_proj is not None, "join_projections() runs at load"
        gate_up = self.gate_up_proj(hidden)
        if lora is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate, up = lora.add(layer, "gate_up", hidden, gate_up).chunk(2, dim=-1)
        product = F.silu(gate) * up
        return lora.add(layer, "down", product, self.down_proj(product))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SparseMoe(spec) if spec.is_sparse(layer_idx) else MLP(spec)
        self.exact: ExactParts | None = None  # set by worker/native/deterministic.py

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: StepCache,
        positions: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """``lora``: the step's rows by adapter; an adapted MLP is dense (``peft_format.check_fits``)."""
        index = self.self_attn.layer_idx
        if self.exact is not None:
            hidden = self.self_attn.forward_exact(self.exact, hidden, rope, positions, cache, lora)
            mlp = self.exact.mlp
            return mlp(hidden, lora, index) if isinstance(mlp, ExactMlp) else mlp(hidden)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, mask, cache, lora)
        normed = self.post_attention_layernorm(hidden)
        if isinstance(self.mlp, MLP):
            return hidden + self.mlp(normed, lora, index)
        return hidden + self.mlp(normed)


class DecoderBody(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers as what they are (``nn.ModuleList`` types its items as plain modules)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]


class NativeCausalLM(nn.Module):
    """``model.*`` and ``lm_head`` as in the checkpoints; ``config`` is the spec."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.config = spec
        self.model = DecoderBody(spec)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # A module that computes the logits in place of the (tied) head weight: the quantized head.
        self.head: nn.Module | None = None
        # The final norm and head on the exact kernels (``--deterministic on``, set with the layers'
        # ``exact`` by worker/native/deterministic.py): hidden states then leave the body unnormalised.
        self.exact_head: exact.ExactLinear | None = None
        self.inv_freq: torch.Tensor = torch.empty(0)
        # cos and [-sin, sin] of every position, [positions, head_dim] (see ``set_rope``).
        self.rope_cos: torch.Tensor = torch.empty(0)
        self.rope_signed_sin: torch.Tensor = torch.empty(0)
        # Multimodal RoPE: which of the temporal, height and width positions each rotary
        # dimension takes (``[head_dim]``); None for plain RoPE.
        self.rope_stream: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def set_rope(self, device: torch.device, max_positions: int | None = None) -> None:
        """RoPE frequencies, computed (not loaded) as transformers computes them, and their cos
        and sin for every position up to ``max_positions`` (default: the model's maximum) as a
        table: a position's values are then looked up, the same bits whichever row or chunk of
        a step it falls in (computed per step, an element could land in a kernel's scalar tail)."""
        dim = self.config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        self.inv_freq = 1.0 / (self.config.rope_theta**exponents)
        positions = max_positions or self.config.max_position_embeddings
        freqs = torch.arange(positions, dtype=torch.float, device=device)[:, None] * self.inv_freq
        sin = freqs.sin()
        self.rope_cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.dtype)
        self.rope_signed_sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        section = self.config.mrope_section
        if section is not None:
            half = _mrope_streams(section, self.config.mrope_interleaved, dim // 2)
            self.rope_stream = torch.cat((half, half)).to(device)

    @property
    def deterministic(self) -> bool:
        """Whether every step runs on the exact kernels: a row's bits depend on that row alone."""
        return self.exact_head is not None

    def join_projections(self) -> None:
        """After the checkpoint is loaded (its names are the separate projections'): q/k/v and
        gate/up become one matmul each."""
        for layer in self.model.decoder_layers():
            layer.self_attn.join_projections()
            layer.mlp.join_projections()

    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and ``[-sin, sin]`` (see ``_rotate``), shaped ``[rows, query_len, 1 (heads), head_dim]``.
        Padding tokens of a prefill step may sit past the table; their results are never read.

        ``position_ids`` ``[3, rows, query_len]``: multimodal RoPE's temporal, height and width
        positions; each dimension's values are looked up at its own stream's position, as
        transformers' Qwen-VL models recompose them (equal streams give plain RoPE's values)."""
        position_ids = position_ids.clamp(max=self.rope_cos.shape[0] - 1)
        if position_ids.dim() == 2:
            return self.rope_cos[position_ids][:, :, None], self.rope_signed_sin[position_ids][:, :, None]
        assert self.rope_stream is not None, "three position streams need multimodal RoPE"
        dims = torch.arange(self.rope_cos.shape[1], device=position_ids.device)
        per_dim = position_ids[self.rope_stream]  # [head_dim, rows, q]: each dimension's position
        per_dim = per_dim.permute(1, 2, 0)
        return self.rope_cos[per_dim, dims][:, :, None], self.rope_signed_sin[per_dim, dims][:, :, None]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings: torch.Tensor = self.model.embed_tokens(input_ids)
        return embeddings

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: StepCache,
        inputs_embeds: torch.Tensor | None = None,
        rope_position_ids: torch.Tensor | None = None,
        deepstack: Deepstack | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """``[rows, query_len]`` ids at ``position_ids`` (same shape: their places in the cache);
        ``mask`` is boolean, broadcastable to ``[rows, heads, query_len, kv_len]``, True where a
        query may attend. ``inputs_embeds``: the ids' embeddings, given where some rows are not
        tokens' (images); ``rope_position_ids``: the positions RoPE rotates by, where they are
        not the cache's (multimodal RoPE, ``[3, rows, query_len]``); ``deepstack``: vision
        features added after the first layers (Qwen3-VL); ``lora``: the rows of each adapter (``lora.py``)."""
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self._rope(position_ids if rope_position_ids is None else rope_position_ids)
        for index, layer in enumerate(self.model.layers):
            hidden = layer(hidden, rope, mask, cache, position_ids, lora)
            if deepstack is not None and index < len(deepstack.features):
                hidden = hidden.index_put((deepstack.rows, deepstack.cols), deepstack.features[index], accumulate=True)
        return hidden if self.exact_head is not None else self.model.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Of ``hidden_states``' output (fp32 with the exact head, else the model's dtype)."""
        if self.exact_head is not None:
            return self.exact_head(hidden)
        if self.head is not None:
            return self.head(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight)
