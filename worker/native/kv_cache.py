"""Slot KV cache held by tokens: per-sequence slots of ``max_model_len`` positions whose memory
is only taken as tokens are written, and given back when the sequence leaves.

This module is the memory the decoder reads and writes: the tensors, a step's write and read
positions, and which pages a slot holds. Which sequence gets a slot and how many blocks it may
hold are the engine's decisions (``worker/engine``: the scheduler, ``kv_blocks.py``,
``shared_prefix.py``); it drives this object through ``hold``, ``vacate``, ``trim`` and
``move_slot``.

Why slots rather than paged blocks: attention then reads each layer's keys and values as one
strided view ``[rows, heads, length, dim]`` with no gather. On CPU, gathering 16-token blocks
into that shape cost more than the attention itself (docs/design/engine.md). Running sequences
are kept in slots ``0..N-1`` (compacted when one leaves), so the decode batch is always a view.

Why that no longer costs concurrency (vAttention's idea, with the CPU's own pager): on the CPU
each slot is virtual memory. A page (4 KiB, one ``block_tokens``-token block of one layer's
head) is only backed when a token is first written into it; a leaving sequence's pages stay
for the next one in its slot until ``trim`` hands pages back (``MADV_DONTNEED``; they read as
zeros afterwards) to keep them within the budget. So there are ``--max-num-seqs`` slots
whatever the budget, and the budget is counted in blocks of tokens actually held (the
engine's ``KVBlockBudget``, the scheduler's admission rule). Reading past a short row's length
(masked) maps the shared zero page and takes no memory. On CUDA the memory is real, so the
slot count still comes from the budget.

An extra scratch slot absorbs the writes of padding tokens when prefill rows of unequal
length share one forward pass (at most one step's token budget of positions). After it come
the prefix slots (the engine's ``shared_prefix.py``): prompt prefixes that many sequences
attend to, held once. A sequence attached to one holds only the positions past the shared
length in its own slot; a step's ``shared_groups`` tell the attention which rows read which
prefix slot.

The object also implements the one method transformers' attention layers call on a cache,
``update(key, value, layer_idx)``; the positions to write come from the step context set by
``begin_decode`` / ``begin_prefill`` just before the forward pass.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

# A slot's positions, rounded up to a multiple of this (whole pages of every head).
SLOT_ALIGN = 64


@dataclass(frozen=True)
class KVCacheLayout:
    """The shape of a model's keys and values: what a slot cache and a prefix cache allocate."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_config(cls, text: Any, dtype: torch.dtype, device: torch.device) -> KVCacheLayout:
        """``text``: the decoder's own config (a ``DecoderSpec`` or a transformers text config; a
        multimodal config's is its ``text_config``, which the engine picks before it asks)."""
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, dtype, device)


class SharedGroup(NamedTuple):
    """Rows of a step (batch indices) that attend to the first ``length`` positions of prefix
    slot ``slot`` before their own."""

    rows: torch.Tensor
    slot: int
    length: int


def _lazily_backed(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """Zeros from an anonymous mapping: the kernel backs it page by page as it is first written
    (``torch.zeros`` would write every page up front, ~0.8 s per GiB of a new worker's start-up on
    a 2-core VM, and hold all of it). Zeros, never uninitialised memory: a decode step reads past
    a short row's length (masked), and masked garbage that happens to be NaN would still poison
    the row (0 x NaN). Huge pages are refused so that memory is taken one 4 KiB block at a time."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Private: a shared anonymous mapping keeps released pages in shmem and reads them back.
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape), mapping


def is_lazily_backed(device: torch.device) -> bool:
    """Whether a slot takes memory only for the tokens written into it (see the module docstring)."""
    return device.type == "cpu" and hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED")


def _position_bytes(layout: KVCacheLayout) -> int:
    """One position of one layer's head (keys or values)."""
    return layout.head_dim * torch.empty((), dtype=layout.dtype).element_size()


def block_tokens(layout: KVCacheLayout) -> int:
    """Tokens per block: the positions of one layer's head that one page holds (32 for a
    64-wide bf16 head). On CUDA, where memory is not paged in, the same unit keeps the count."""
    return max(1, mmap.PAGESIZE // _position_bytes(layout))


class SlotKVCache:
    def __init__(
        self,
        layout: KVCacheLayout,
        num_slots: int,
        max_model_len: int,
        held_by_tokens: bool | None = None,
        num_prefix_slots: int = 0,
    ) -> None:
        """``held_by_tokens`` (default: wherever the memory is lazily backed): ``trim`` hands pages
        back; without it a slot keeps the memory it once took, for its next sequence."""
        if num_slots < 1:
            raise ValueError("the KV cache budget does not fit a single sequence of max_model_len tokens")
        self.layout = layout
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        # Positions per slot: whole blocks of batch-invariant attention's key reads (lazily backed
        # memory on the CPU: the few positions past max_model_len are never written).
        self.positions = -(-max_model_len // SLOT_ALIGN) * SLOT_ALIGN
        self.scratch_slot = num_slots
        self.first_prefix_slot = num_slots + 1
        self.num_prefix_slots = num_prefix_slots
        num_all = num_slots + 1 + num_prefix_slots
        shape = (num_all, layout.num_kv_heads, self.positions, layout.head_dim)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._mappings: list[mmap.mmap] = []  # the lazily backed memory under keys and values
        lazily_backed = is_lazily_backed(layout.device)
        self.held_by_tokens = lazily_backed if held_by_tokens is None else held_by_tokens and lazily_backed
        for _ in range(layout.num_layers):
            for tensors in (self.keys, self.values):
                if lazily_backed:
                    tensor, mapping = _lazily_backed(shape, layout.dtype)
                    self._mappings.append(mapping)
                else:
                    tensor = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
                tensors.append(tensor)
        self._row_bytes = _position_bytes(layout)
        self.block_tokens = block_tokens(layout)
        # What each slot's owner holds: ``_held`` blocks from block ``_first`` on (a sequence
        # attached to a shared prefix holds nothing before its end); the pages a slot may have
        # taken lie within blocks ``[_lo, _hi)``.
        self._held = [0] * num_all
        self._first = [0] * num_all
        self._lo = [0] * num_all
        self._hi = [0] * num_all
        self._write_slots: torch.Tensor | None = None
        self._write_positions: torch.Tensor | None = None
        self._read_rows: torch.Tensor | slice = slice(0, 0)
        self._read_start = 0
        self._kv_len = 0
        self._single_position: int | None = None  # a one-row decode step's position
        self.shared_groups: tuple[SharedGroup, ...] = ()

    @property
    def num_bytes(self) -> int:
        """The address space the slots span (on the CPU, not the memory they hold)."""
        return 2 * sum(t.numel() * t.element_size() for t in self.keys)

    # -- step context -----------------------------------------------------------------------
    def begin_decode(
        self,
        num_rows: int,
        positions: torch.Tensor,
        kv_len: int,
        read_start: int = 0,
        shared_groups: tuple[SharedGroup, ...] = (),
    ) -> None:
        """Rows ``0..num_rows-1`` each write one token at ``positions[row]``; attention reads their
        own positions ``[read_start, kv_len)`` (and the ``shared_groups``' prefixes)."""
        self._write_slots = torch.arange(num_rows, device=positions.device)[:, None]
        self._write_positions = positions[:, None]
        self._read_rows = slice(0, num_rows)
        self._read_start = read_start
        self.shared_groups = shared_groups
        self._kv_len = kv_len
        # One row (one stream): a plain indexed copy, ~4x cheaper than the scattered write below.
        self._single_position = int(positions[0]) if num_rows == 1 else None

    def begin_prefill(
        self,
        slots: torch.Tensor,
        write_slots: torch.Tensor,
        write_positions: torch.Tensor,
        kv_len: int,
        read_start: int = 0,
        shared_groups: tuple[SharedGroup, ...] = (),
    ) -> None:
        """Rows ``slots`` write ``[rows, query_len]`` tokens; padding is pointed at the scratch slot."""
        self._write_slots = write_slots
        self._write_positions = write_positions
        self._read_start = read_start
        self.shared_groups = shared_groups
        first = int(slots[0])
        is_contiguous = bool((slots == torch.arange(first, first + len(slots), device=slots.device)).all())
        self._read_rows = slice(first, first + len(slots)) if is_contiguous else slots
        self._kv_len = kv_len
        self._single_position = None

    # -- the transformers Cache protocol ------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._single_position is not None:
            keys[0, :, self._single_position] = key_states[0, :, 0]
            values[0, :, self._single_position] = value_states[0, :, 0]
        else:
            # [rows, heads, q, dim] → index [rows, q] picks [rows, q, heads, dim]
            keys[self._write_slots, :, self._write_positions] = key_states.transpose(1, 2)
            values[self._write_slots, :, self._write_positions] = value_states.transpose(1, 2)
        positions = slice(self._read_start, self._kv_len)
        return keys[self._read_rows, :, positions], values[self._read_rows, :, positions]

    def shared_kv(self, layer_idx: int, group: SharedGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """A shared prefix's keys and values, ``[kv_heads, length, dim]`` each (views)."""
        return self.keys[layer_idx][group.slot, :, : group.length], self.values[layer_idx][
            group.slot, :, : group.length
        ]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    # -- slot management --------------------------------------------------------------------
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` that its sequence holds into slot
        ``dst`` (compaction); the blocks ``src``'s sequence held are ``dst``'s now."""
        first = self._first[src] * self.block_tokens
        self.copy_positions(src, dst, first, length)
        self.hold(dst, self._held[src], first)

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Positions ``[start, end)`` of every layer's heads, from slot ``src`` to slot ``dst``."""
        if end <= start:
            return
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[dst, :, start:end] = keys[src, :, start:end]
            values[dst, :, start:end] = values[src, :, start:end]

    # -- memory held by tokens (see the module docstring) -------------------------------------------
    def hold(self, slot: int, num_blocks: int, first_position: int = 0) -> None:
        """The sequence in ``slot`` holds ``num_blocks`` blocks from ``first_position`` (a block
        boundary: where its shared prefix ends) on; it may write their positions."""
        first = first_position // self.block_tokens
        self._held[slot], self._first[slot] = num_blocks, first
        if num_blocks:
            empty = self._hi[slot] <= self._lo[slot]
            self._lo[slot] = first if empty else min(self._lo[slot], first)
            self._hi[slot] = max(self._hi[slot], first + num_blocks)

    def vacate(self, slot: int) -> None:
        """Its sequence left. The slot's pages stay for the next sequence put there (a fresh page
        costs a fault and a zeroing: 3 % of 32-stream throughput when every slot's were handed
        back at once) until ``trim`` needs them."""
        self._held[slot] = 0

    def trim(self, max_blocks: int) -> None:
        """Hand pages back until the slots hold at most ``max_blocks`` blocks' worth: first those of
        empty slots, then those past what each slot's sequence holds. They read as zeros after."""
        if not self.held_by_tokens or self.num_backed_blocks <= max_blocks:
            return
        excess = self.num_backed_blocks - max_blocks
        slots = [slot for slot in range(len(self._held)) if slot != self.scratch_slot]
        by_emptiness = sorted(slots, key=lambda slot: self._held[slot] > 0)
        tokens = self.block_tokens
        for slot in by_emptiness:
            if excess <= 0:
                return
            lo, hi = self._lo[slot], self._hi[slot]
            held, first = self._held[slot], self._first[slot]
            if hi - lo > held:
                if held:
                    self._release(slot, lo * tokens, first * tokens)
                    self._release(slot, (first + held) * tokens, hi * tokens)
                else:
                    self._release(slot, lo * tokens, hi * tokens)
                self._lo[slot], self._hi[slot] = (first, first + held) if held else (0, 0)
                excess -= hi - lo - held

    @property
    def num_backed_blocks(self) -> int:
        """Blocks' worth of pages the slots may hold (an upper bound of their memory)."""
        return sum(hi - lo for lo, hi in zip(self._lo, self._hi, strict=True) if hi > lo)

    def _release(self, slot: int, first: int, end: int) -> None:
        """``MADV_DONTNEED`` on positions ``[first, end)`` of every layer's heads in ``slot``: only
        whole pages inside the range (all of it when a head's positions start page-aligned)."""
        if not self.held_by_tokens or end <= first:
            return
        page = mmap.PAGESIZE
        for head in range(self.layout.num_kv_heads):
            row = (slot * self.layout.num_kv_heads + head) * self.positions
            start = -(-(row + first) * self._row_bytes // page) * page
            stop = (row + min(end, self.positions)) * self._row_bytes // page * page
            if stop > start:
                for mapping in self._mappings:
                    mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)
