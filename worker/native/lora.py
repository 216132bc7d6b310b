"""LoRA adapters in the native decoder's step: each row's update ``scaling * B @ A x`` added to
the base projection's output, for the rows of each adapter, without merging any weight, so rows
of different adapters and of the base model share one batch (S-LoRA's and Punica's shape, done
per adapter group: a CPU's matmul over a group's rows reads the group's small matrices once).

The decoder joins q/k/v and gate/up into one matmul each (``decoder.JoinedLinear``); an adapter's
updates are joined the same way: the parts' ``A`` stacked (one matmul of the shared input) and
their ``B`` block-diagonal (absent targets are empty blocks), the scaling folded into ``B``.

Under the exact numerics (``--deterministic on``) the two small matmuls run on the exact kernels,
``A`` with the same fused prologue as the base matmul it sits beside (the RMSNorm before q/k/v
and gate/up, the SwiGLU product before down), so a row's update, like the rest of its step, is a
function of that row alone; it is added to the row's base output elementwise. Rows without an
adapter are not touched: the base model's bits are the same beside adapters as without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from worker.native import exact
from worker.native.peft_format import LoraPair, PeftAdapter, TargetShapes
from worker.native.spec import DecoderSpec

Site = Literal["qkv", "o", "gate_up", "down"]
SITE_PARTS: dict[Site, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def target_shapes(spec: DecoderSpec) -> TargetShapes:
    q_width, kv_width = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    hidden, inner = spec.hidden_size, spec.intermediate_size
    shapes = {
        "q_proj": (hidden, q_width), "k_proj": (hidden, kv_width), "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }  # fmt: skip
    sparse = spec.moe.sparse_layers if spec.moe is not None else frozenset()
    return TargetShapes(spec.num_hidden_layers, shapes, sparse)


class LibraryUpdate(NamedTuple):
    """A site's update on the library kernels, in the model's dtype: ``x`` is the normalised
    input (or the SwiGLU product) the base matmul read."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], scaling folded in

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.a), self.b)


class ExactUpdate(NamedTuple):
    """A site's update on the exact kernels, fp32: ``x`` is what the base exact matmul read
    (before its prologue)."""

    a: exact.ExactLinear
    b: exact.ExactLinear

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


Update = LibraryUpdate | ExactUpdate


def _joined(pairs: dict[str, LoraPair], parts: tuple[str, ...], outs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' ``A`` stacked and their ``B`` (times scaling) block-diagonal: ``[rank, in]``, ``[out, rank]``."""
    a = torch.cat([pairs[part].a for part in parts if part in pairs])
    blocks = [
        pairs[part].b * pairs[part].scaling if part in pairs else torch.zeros(out, 0)
        for part, out in zip(parts, outs, strict=True)
    ]
    return a, torch.block_diag(*blocks)


@dataclass(frozen=True)
class LoraModel:
    """An adapter made ready for one model: each layer's updates by site (absent: not adapted)."""

    name: str
    key: int  # what the prefix caches mix into an adapted prompt's hashes (from the adapter's digest)
    layers: tuple[dict[Site, Update], ...]
    nbytes: int


@dataclass(frozen=True)
class LayerNorms:
    """The norms an exact update's prologue fuses, per layer (the base matmuls' own)."""

    attention: tuple[torch.Tensor, float]
    mlp: tuple[torch.Tensor, float]


def prepare(
    name: str, digest: str, adapter: PeftAdapter, spec: DecoderSpec, dtype: torch.dtype,
    norms: list[LayerNorms] | None,
) -> LoraModel:  # fmt: skip
    """``adapter`` (whose files' SHA-256 is ``digest``) as ``LoraModel`` for a model of ``spec``;
    ``norms`` given: on the exact kernels."""
    shapes = target_shapes(spec).shapes
    layers: list[dict[Site, Update]] = []
    nbytes = 0
    for index in range(spec.num_hidden_layers):
        sites: dict[Site, Update] = {}
        for site, parts in SITE_PARTS.items():
            pairs = {part: adapter.pairs[(index, part)] for part in parts if (index, part) in adapter.pairs}
            if not pairs:
                continue
            a, b = _joined(pairs, parts, [shapes[part][1] for part in parts])
            if norms is None:
                library = LibraryUpdate(a.to(dtype).contiguous(), b.to(dtype).contiguous())
                sites[site] = library
                nbytes += (a.numel() + b.numel()) * library.b.element_size()
                continue
            prologue, norm_weight, eps = exact.PROLOGUE_NONE, None, 0.0
            if site in ("qkv", "gate_up"):
                norm_weight, eps = norms[index].attention if site == "qkv" else norms[index].mlp
                prologue = exact.PROLOGUE_RMS_NORM
            elif site == "down":
                prologue = exact.PROLOGUE_SILU_MUL
            packed_a, packed_b = exact.pack_int8(a), exact.pack_int8(b)
            sites[site] = ExactUpdate(
                exact.ExactLinear(packed_a, None, prologue, norm_weight, eps, out_float32=True),
                exact.ExactLinear(packed_b, None, out_float32=True),
            )
            nbytes += packed_a.nbytes + packed_b.nbytes
        layers.append(sites)
    return LoraModel(name, int(digest[:15], 16), tuple(layers), nbytes)


class LoraStep:
    """A step's rows by adapter: ``groups`` pairs an adapter with the row indices (a tensor) it
    serves; rows in no group are the base model's."""

    def __init__(self, groups: list[tuple[LoraModel, torch.Tensor]]) -> None:
        self.groups = groups

    @classmethod
    def of_rows(cls, adapters: list[LoraModel | None], device: torch.device) -> LoraStep | None:
        """From each row's adapter (None: the base model's); None when no row has one."""
        rows_of: dict[int, tuple[LoraModel, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                rows_of.setdefault(id(adapter), (adapter, []))[1].append(row)
        if not rows_of:
            return None
        return cls(
            [(adapter, torch.tensor(rows, dtype=torch.long, device=device)) for adapter, rows in rows_of.values()]
        )

    def add(self, layer: int, site: Site, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``x``, rows first) with each adapted row's update added."""
        for adapter, rows in self.groups:
            update = adapter.layers[layer].get(site)
            if update is None:
                continue
            delta = update.delta(x[rows])
            y[rows] = (y[rows].float() + delta.float()).to(y.dtype)
        return y
