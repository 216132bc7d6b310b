"""Slot KV cache: a fixed memory budget split into per-sequence slots of ``max_model_len`` positions.

Why slots rather than paged blocks: attention then reads each layer's keys and values as one
strided view ``[rows, heads, length, dim]`` with no gather. On CPU, gathering 16-token blocks
into that shape cost more than the attention itself (see bench/README.md). Running sequences
are kept in slots ``0..N-1`` (compacted when one leaves), so the decode batch is always a view.

An extra scratch slot absorbs the writes of padding tokens when prefill rows of unequal
length share one forward pass.

The object also implements the one method transformers' attention layers call on a cache,
``update(key, value, layer_idx)``; the positions to write come from the step context set by
``begin_decode`` / ``begin_prefill`` just before the forward pass.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from worker.engine.model_config import text_config


@dataclass(frozen=True)
class KVCacheLayout:
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
    def from_config(cls, config: object, dtype: torch.dtype, device: torch.device) -> KVCacheLayout:
        text = text_config(config)
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, dtype, device)


def num_slots_for_budget(layout: KVCacheLayout, max_model_len: int, budget_bytes: int) -> int:
    """How many full-length slots (plus the scratch slot) fit in the KV memory budget."""
    slot_bytes = layout.bytes_per_token * max_model_len
    return max(0, budget_bytes // slot_bytes - 1)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros, never uninitialised memory: a decode step reads past a short row's length (masked
    out), and masked garbage that happens to be NaN would still poison the row (0 × NaN).

    On the CPU the zeros come from an anonymous mapping, which the kernel hands out zeroed page
    by page as the cache is first written: ``torch.zeros`` writes every page up front, ~0.8 s
    per GiB of a new worker's start-up on a 2-core VM. The budget still bounds the cache.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, num_bytes)  # the tensor holds the mapping alive
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


class SlotKVCache:
    def __init__(self, layout: KVCacheLayout, num_slots: int, max_model_len: int) -> None:
        if num_slots < 1:
            raise ValueError("the KV cache budget does not fit a single sequence of max_model_len tokens")
        self.layout = layout
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.scratch_slot = num_slots
        shape = (num_slots + 1, layout.num_kv_heads, max_model_len, layout.head_dim)
        self.keys = [_zeroed(shape, layout.dtype, layout.device) for _ in range(layout.num_layers)]
        self.values = [_zeroed(shape, layout.dtype, layout.device) for _ in range(layout.num_layers)]
        self._write_slots: torch.Tensor | None = None
        self._write_positions: torch.Tensor | None = None
        self._read_rows: torch.Tensor | slice = slice(0, 0)
        self._kv_len = 0
        self._single_position: int | None = None  # a one-row decode step's position

    @property
    def num_bytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.keys)

    # -- step context -----------------------------------------------------------------------
    def begin_decode(self, num_rows: int, positions: torch.Tensor, kv_len: int) -> None:
        """Rows ``0..num_rows-1`` each write one token at ``positions[row]``."""
        self._write_slots = torch.arange(num_rows, device=positions.device)[:, None]
        self._write_positions = positions[:, None]
        self._read_rows = slice(0, num_rows)
        self._kv_len = kv_len
        # One row (one stream): a plain indexed copy, ~4x cheaper than the scattered write below.
        self._single_position = int(positions[0]) if num_rows == 1 else None

    def begin_prefill(
        self, slots: torch.Tensor, write_slots: torch.Tensor, write_positions: torch.Tensor, kv_len: int
    ) -> None:
        """Rows ``slots`` write ``[rows, query_len]`` tokens; padding is pointed at the scratch slot."""
        self._write_slots = write_slots
        self._write_positions = write_positions
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
        return keys[self._read_rows, :, : self._kv_len], values[self._read_rows, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    # -- slot management --------------------------------------------------------------------
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (compaction)."""
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]
