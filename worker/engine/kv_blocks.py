"""The KV budget counted in blocks of tokens held, not in slots: what the scheduler admits and
preempts by, and what ``kv_cache_usage_perc`` reports.

A sequence holds ``ceil(tokens / block_tokens)`` blocks for the tokens its slot holds. On the
CPU that is the memory it really takes (``worker/native/kv_cache.py``: a block is one page of
each layer's heads, backed when first written and handed back when the sequence leaves), so a
budget of N blocks bounds the KV memory whatever the number of slots.
"""

from __future__ import annotations

from typing import Protocol


class HoldsBlocks(Protocol):
    num_kv_blocks: int


class KVBlockBudget:
    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError("a KV budget needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.num_used = 0
        # Admission leaves this many blocks free, so that running sequences can grow a while
        # before one has to be preempted (vLLM keeps 1 % the same way).
        self.watermark = max(1, num_blocks // 100)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used

    @property
    def usage(self) -> float:
        """Share of the budget held (0-1)."""
        return self.num_used / self.num_blocks

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` fits the budget with nothing else held."""
        return self.blocks_for(num_tokens) + self.watermark <= self.num_blocks

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new sequence may take blocks for ``num_tokens`` now, leaving the watermark."""
        return self.can_take(self.blocks_for(num_tokens))

    def can_take(self, num_blocks: int) -> bool:
        """Whether a new sequence may take ``num_blocks`` blocks now, leaving the watermark."""
        return num_blocks + self.watermark <= self.num_free

    def extra_blocks(self, holder: HoldsBlocks, num_tokens: int) -> int:
        """Blocks ``holder`` still needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - holder.num_kv_blocks)

    def grow(self, holder: HoldsBlocks, num_tokens: int) -> None:
        """Let ``holder`` hold ``num_tokens`` tokens; the caller made sure the blocks are free."""
        extra = self.extra_blocks(holder, num_tokens)
        if extra > self.num_free:
            raise RuntimeError(f"KV budget overdrawn: {extra} blocks wanted, {self.num_free} free")
        holder.num_kv_blocks += extra
        self.num_used += extra

    def shrink(self, holder: HoldsBlocks, num_blocks: int) -> None:
        """``holder`` gives back ``num_blocks`` of its blocks (handed over to a shared prefix)."""
        if num_blocks > holder.num_kv_blocks:
            raise RuntimeError(f"KV budget: {num_blocks} blocks given back of {holder.num_kv_blocks} held")
        holder.num_kv_blocks -= num_blocks
        self.num_used -= num_blocks

    def free(self, holder: HoldsBlocks) -> None:
        self.num_used -= holder.num_kv_blocks
        holder.num_kv_blocks = 0
