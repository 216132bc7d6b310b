"""LoRA adapters in the native decoder's step: each row's update ``scaling * B @ A x`` added to
the base projection's output, for the rows of each adapter, without merging any weight, so rows
of different adapters and of the base model share one batch (S-LoRA's and Punica's shape, done
per adapter group: a CPU's matmul over a group's rows reads the group's small matrices once).

The decoder joins q/k/v and gate/up into one matmul each (``decoder.JoinedLinear``); an adapter's
updates are joined the same way: the parts' ``A`` stacked (one matmul of the shared input) and
their ``B`` block-diagonal (absent targets are empty blocks), the scaling folded into ``B``;
the exact kernels keep ``B``'s blocks alone (``exact.LoraB``), not the zeros between them.

Under the exact numerics (``--deterministic on``) the two small matmuls run inside the base
matmul's own call (``exact.matmul``'s ``lora``): ``A`` reads the activations the base matmul
quantized after its fused prologue (the RMSNorm before q/k/v and gate/up, the SwiGLU product
before down), so a row's update, like the rest of its step, is a function of that row alone; it
is added to the row's base output elementwise. Rows without an adapter are not touched: the base
model's bits are the same beside adapters as without them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from shared.adapter_files import ModelShapes
from worker.native import exact
from worker.native.peft_format import LoraPair, PeftAdapter
from worker.native.spec import DecoderSpec

Site = Literal["qkv", "o", "gate_up", "down"]
SITE_PARTS: dict[Site, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def model_shapes(spec: DecoderSpec, max_rank: int) -> ModelShapes:
    """What an adapter of this model must fit (``max_rank``: the worker's ``--max-lora-rank``)."""
    q_width, kv_width = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    hidden, inner = spec.hidden_size, spec.intermediate_size
    shapes = {
        "q_proj": (hidden, q_width), "k_proj": (hidden, kv_width), "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }  # fmt: skip
    sparse = sorted(spec.moe.sparse_layers) if spec.moe is not None else []
    return ModelShapes(num_layers=spec.num_hidden_layers, shapes=shapes, sparse_layers=sparse, max_rank=max_rank)


@dataclass(frozen=True)
class Part:
    """One adapter's update at one site of one layer, of rank ``width`` (its parts' ranks summed):
    ``A`` ``[width, in]`` and ``B`` ``[out, width]`` (scaling folded in), as floats in the model's
    dtype for the library kernels; or packed for the exact ones, ``B`` by parts (``exact.LoraB``)."""

    width: int
    a: torch.Tensor | exact.PackedWeight
    b: torch.Tensor | exact.LoraB

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes for w in (self.a, self.b))


def _joined(pairs: dict[str, LoraPair], parts: tuple[str, ...], outs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' ``A`` stacked and their ``B`` (times scaling) block-diagonal: ``[rank, in]``, ``[out, rank]``."""
    a = torch.cat([pairs[part].a for part in parts if part in pairs])
    blocks = [
        pairs[part].b * pairs[part].scaling if part in pairs else torch.zeros(out, 0)
        for part, out in zip(parts, outs, strict=True)
    ]
    return a, torch.block_diag(*blocks)


def _exact_b(pairs: dict[str, LoraPair], parts: tuple[str, ...], outs: list[int]) -> exact.LoraB:
    """The parts' ``B`` (times scaling) as the exact kernels keep them: each its own block of the
    joined update, its outputs from its own slice of ``A x`` (``_joined``'s order)."""
    blocks, n0, k0 = [], 0, 0
    for part, out in zip(parts, outs, strict=True):
        if part in pairs:
            pair = pairs[part]
            blocks.append((n0, k0, pair.b * pair.scaling))
            k0 += pair.a.shape[0]
        n0 += out
    return exact.pack_lora_b(blocks, n0)


@dataclass(frozen=True, eq=False)  # compared and hashed as the object it is
class LoraModel:
    """An adapter made ready for one model: each layer's updates by site (absent: not adapted)."""

    name: str
    key: int  # what the prefix caches mix into an adapted prompt's hashes (from the adapter's digest)
    layers: tuple[dict[Site, Part], ...]
    nbytes: int


def prepare(
    name: str, digest: str, adapter: PeftAdapter, spec: DecoderSpec, dtype: torch.dtype, on_exact: bool
) -> LoraModel:  # fmt: skip
    """``adapter`` (whose files' SHA-256 is ``digest``) as ``LoraModel`` for a model of ``spec``
    whose matmuls run on the exact kernels (``on_exact``) or the library's in ``dtype``."""
    shapes = model_shapes(spec, 0).shapes
    layers: list[dict[Site, Part]] = []
    for index in range(spec.num_hidden_layers):
        sites: dict[Site, Part] = {}
        for site, parts in SITE_PARTS.items():
            pairs = {part: adapter.pairs[(index, part)] for part in parts if (index, part) in adapter.pairs}
            if not pairs:
                continue
            outs = [shapes[part][1] for part in parts]
            a, b = _joined(pairs, parts, outs)
            if on_exact:
                sites[site] = Part(a.shape[0], exact.pack_int8(a), _exact_b(pairs, parts, outs))
            else:
                sites[site] = Part(a.shape[0], a.to(dtype).contiguous(), b.to(dtype).contiguous())
        layers.append(sites)
    nbytes = sum(part.nbytes for sites in layers for part in sites.values())
    return LoraModel(name, int(digest[:15], 16), tuple(layers), nbytes)


@dataclass(frozen=True)
class JoinedSite:
    """The updates of several adapters at one site of one layer, each adapter's rank-wide slice
    of ``A x`` side by side (``slices``). On the library kernels: their ``A`` one after another
    (``[sum of widths, in]``) and their ``B`` side by side (``[out, sum of widths]``), a row
    keeping only its own slice before ``B``. On the exact kernels: each row through its own
    adapter's ``A`` and ``B`` alone (``exact.matmul``'s ``lora``), as it would be computed alone."""

    members: tuple[int, ...]  # indices into the step's adapters, in slice order
    slices: tuple[tuple[int, int], ...]  # (start, width) of each member's slice
    width: int
    a: torch.Tensor | object  # the library's ``A``, or the exact kernels' ``exact.lora_factors``
    b: torch.Tensor | None  # the library's; the exact kernels' factors are all in ``a``

    @classmethod
    def of(cls, parts: list[tuple[int, Part]]) -> JoinedSite:
        members = tuple(index for index, _ in parts)
        starts = [0]
        for _, part in parts:
            starts.append(starts[-1] + part.width)
        slices = tuple((start, part.width) for start, (_, part) in zip(starts, parts, strict=False))
        width = starts[-1]
        if isinstance(parts[0][1].a, torch.Tensor):
            a = torch.cat([part.a for _, part in parts])  # type: ignore[misc]
            b = torch.cat([part.b for _, part in parts], dim=1)  # type: ignore[misc]
            return cls(members, slices, width, a, b)
        factors = exact.lora_factors([part.a for _, part in parts], [part.b for _, part in parts])  # type: ignore[misc]
        return cls(members, slices, width, factors, None)

    def added(self, x: torch.Tensor, y: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """``y`` plus each row's update of ``x``, in ``y``'s dtype (the library kernels)."""
        assert isinstance(self.a, torch.Tensor) and self.b is not None
        xs, ys = (x, y) if plan.rows is None else (x[plan.rows], y[plan.rows])
        low = F.linear(xs, self.a)
        added = ys + F.linear(low if plan.mask is None else low * plan.mask.to(low.dtype), self.b)
        if plan.rows is None:
            return added
        y[plan.rows] = added
        return y


_ExactRows = dict[tuple[int, Site], exact.LoraRows | None]


class _Joins(NamedTuple):
    """One set of adapters' joined updates by site; and the exact kernels' arguments by the
    step's rows (each row's adapter, and the tokens a row), for the last few layouts."""

    sites: dict[tuple[int, Site], JoinedSite | None]
    rows: OrderedDict[tuple[tuple[int, ...], int], _ExactRows]


class JoinCache:
    """Joined updates by the set of adapters a step holds, for the last few sets (a set changes
    when a request of a new adapter arrives or the last of one ends, not every step)."""

    def __init__(self, max_sets: int = 4, max_layouts: int = 8) -> None:
        self.max_sets = max_sets
        self.max_layouts = max_layouts
        self._sets: OrderedDict[tuple[int, ...], _Joins] = OrderedDict()

    def joined(self, adapters: tuple[LoraModel, ...]) -> _Joins:
        key = tuple(id(adapter) for adapter in adapters)
        found = self._sets.get(key)
        if found is None:
            found = self._sets[key] = _Joins({}, OrderedDict())
            while len(self._sets) > self.max_sets:
                self._sets.popitem(last=False)
        else:
            self._sets.move_to_end(key)
        return found

    def exact_rows(self, joins: _Joins, row_adapter: tuple[int, ...], query_len: int) -> _ExactRows:
        key = (row_adapter, query_len)
        found = joins.rows.get(key)
        if found is None:
            found = joins.rows[key] = {}
            while len(joins.rows) > self.max_layouts:
                joins.rows.popitem(last=False)
        else:
            joins.rows.move_to_end(key)
        return found


class _Plan(NamedTuple):
    """Which rows a joined site updates. Library kernels: the rows (None: every row, in order)
    and each one's slice mask, ``[rows, 1, width]`` (None: the site joins one adapter). Exact
    kernels: each row's member of the site (-1: none)."""

    rows: torch.Tensor | None
    mask: torch.Tensor | None
    group: torch.Tensor


class LoraStep:
    """A step's rows by adapter: each adapted projection adds every adapted row's update, all
    adapters' at once (``JoinedSite``); rows of no adapter are the base model's, untouched."""

    def __init__(
        self, adapters: tuple[LoraModel, ...], row_adapter: list[int], device: torch.device, joins: JoinCache
    ) -> None:
        self.adapters = adapters
        self.row_adapter = row_adapter  # each row's index in ``adapters``; -1: the base model's
        self.device = device
        self._joins = joins
        self._set = joins.joined(adapters)
        self._joined = self._set.sites
        # By a joined site's members and slices: sites of one layout share their rows and masks.
        self._plans: dict[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], _Plan] = {}
        self._exact: dict[int, _ExactRows] = {}  # by tokens a row

    @classmethod
    def of_rows(
        cls, adapters: list[LoraModel | None], device: torch.device, joins: JoinCache | None = None
    ) -> LoraStep | None:
        """From each row's adapter (None: the base model's); None when no row has one."""
        distinct: dict[int, int] = {}
        for adapter in adapters:
            if adapter is not None:
                distinct.setdefault(id(adapter), len(distinct))
        if not distinct:
            return None
        ordered = tuple(dict.fromkeys(adapter for adapter in adapters if adapter is not None))
        row_adapter = [-1 if adapter is None else distinct[id(adapter)] for adapter in adapters]
        return cls(ordered, row_adapter, device, joins or JoinCache(1))

    def _site(self, layer: int, site: Site) -> JoinedSite | None:
        key = (layer, site)
        if key not in self._joined:
            parts = [
                (i, adapter.layers[layer][site])
                for i, adapter in enumerate(self.adapters)
                if site in adapter.layers[layer]
            ]
            self._joined[key] = JoinedSite.of(parts) if parts else None
        return self._joined[key]

    def _plan(self, joined: JoinedSite) -> _Plan:
        layout = (joined.members, joined.slices)
        plan = self._plans.get(layout)
        if plan is None:
            where = {member: slot for slot, member in enumerate(joined.members)}
            group = [where.get(index, -1) for index in self.row_adapter]
            rows = [row for row, slot in enumerate(group) if slot >= 0]
            mask = None
            if len(joined.members) > 1:
                mask = torch.zeros(len(rows), 1, joined.width)
                for i, row in enumerate(rows):
                    start, width = joined.slices[group[row]]
                    mask[i, 0, start : start + width] = 1.0
                mask = mask.to(self.device)
            every = len(rows) == len(self.row_adapter)
            plan = _Plan(
                None if every else torch.tensor(rows, device=self.device), mask, torch.tensor(group, device=self.device)
            )
            self._plans[layout] = plan
        return plan

    def add(self, layer: int, site: Site, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``x``, rows first) with each adapted row's update added, on
        the library kernels."""
        joined = self._site(layer, site)
        if joined is None:
            return y
        return joined.added(x, y, self._plan(joined))

    def rows(self, layer: int, site: Site, query_len: int) -> exact.LoraRows | None:
        """The exact kernels' updates at ``site`` for the base matmul's call (``exact.matmul``'s
        ``lora``): each of ``query_len`` tokens of a row in its row's group; None: none here.
        Kept from step to step while the rows' adapters stay (a decode step asks 4 a layer)."""
        found = self._exact.get(query_len)
        if found is None:
            found = self._exact[query_len] = self._joins.exact_rows(self._set, tuple(self.row_adapter), query_len)
        key = (layer, site)
        if key not in found:
            joined = self._site(layer, site)
            if joined is None:
                found[key] = None
            else:
                assert not isinstance(joined.a, torch.Tensor)
                group = self._plan(joined).group
                found[key] = exact.LoraRows(joined.a, group if query_len == 1 else group.repeat_interleave(query_len))
        return found[key]
