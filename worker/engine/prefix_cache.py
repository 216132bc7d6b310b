"""Prefix caching: KV of block-aligned token prefixes, kept in a pool of its own.

Agents resend the same system prompt and tool list on every turn. A sequence's full blocks are
stored when its prompt is computed and when it finishes; a new sequence looks up the longest
chain of cached blocks for its prompt and copies them into its slot instead of recomputing
them. A block is named by the hash of its tokens chained with its predecessor's hash, so equal
blocks after different prefixes never collide. Eviction is least-recently-used: a lookup
touches a chain from its first block, so tails are evicted before the heads they depend on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from worker.engine.kv_blocks import KVBlockBudget
from worker.engine.sequence import Sequence
from worker.native.kv_cache import SlotKVCache

BLOCK_SIZE = 32


@dataclass
class PrefixCacheStats:
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


def block_hashes(token_ids: list[int], num_blocks: int, block_size: int = BLOCK_SIZE) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, num_blocks, block_size)
    return hashes


def extend_block_hashes(hashes: list[int], token_ids: list[int], num_blocks: int, block_size: int) -> None:
    """Append the chained hashes of blocks ``len(hashes)..num_blocks-1`` of ``token_ids`` (whose
    earlier blocks ``hashes`` already holds)."""
    previous = hashes[-1] if hashes else 0
    for index in range(len(hashes), num_blocks):
        previous = hash((previous, *token_ids[index * block_size : (index + 1) * block_size]))
        hashes.append(previous)


class PrefixCache:
    """The ``copy`` prefix policy (``prefixes.Prefixes``) over the slots of ``cache``."""

    def __init__(self, cache: SlotKVCache, num_blocks: int) -> None:
        layout = cache.layout
        self.cache = cache
        self.num_blocks = num_blocks
        shape = (num_blocks, layout.num_kv_heads, BLOCK_SIZE, layout.head_dim)
        # empty, not zeros: a block is only ever read after it was written, and on CPU the pages
        # are then only taken as blocks fill (a second less at start-up per GiB).
        self._keys = [torch.empty(shape, dtype=layout.dtype, device=layout.device) for _ in range(layout.num_layers)]
        self._values = [torch.empty(shape, dtype=layout.dtype, device=layout.device) for _ in range(layout.num_layers)]
        self._block_of: OrderedDict[int, int] = OrderedDict()  # chained hash → pool index, LRU first
        self._free = list(range(num_blocks))
        self.stats = PrefixCacheStats()
        self.evictions = 0

    @property
    def num_bytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self._keys)

    # -- the prefix policy ------------------------------------------------------------------------
    @property
    def idle_blocks(self) -> int:
        return 0  # the pool is memory of its own, not KV blocks

    def reserve(self, seq: Sequence, budget: KVBlockBudget) -> bool:
        return budget.can_admit(seq.sched.num_prefill_tokens + 1)

    def fill(self, seq: Sequence, slot: int) -> int:
        return self.load(seq.cache_keys(seq.sched.prefill_token_ids), self.cache, slot)

    def balance(self, running: list[Sequence]) -> None:
        pass

    def leave(self, seq: Sequence) -> None:
        pass

    def remember(self, seq: Sequence, tokens: list[int], num_computed: int, finishing: bool) -> None:
        if seq.sched.slot is not None:
            self.store(seq.cache_keys(tokens), num_computed, self.cache, seq.sched.slot)

    def mark(self, seq: Sequence) -> list[int]:
        tokens = seq.cache_keys(seq.prompt_token_ids)
        return block_hashes(tokens, len(tokens) // BLOCK_SIZE)

    def cached_blocks(self, mark: list[int]) -> int:
        held = 0
        for block_hash in mark:
            if block_hash not in self._block_of:
                break
            held += 1
        return held

    # -- the pool -----------------------------------------------------------------------------------

    def load(self, token_ids: list[int], cache: SlotKVCache, slot: int) -> int:
        """Copy the longest cached prefix of ``token_ids`` (leaving at least one token to compute)
        into ``slot``; returns how many tokens it covers."""
        self.stats.num_queried_tokens += len(token_ids)
        blocks: list[int] = []
        for block_hash in block_hashes(token_ids, (len(token_ids) - 1) // BLOCK_SIZE):
            block = self._block_of.get(block_hash)
            if block is None:
                break
            self._block_of.move_to_end(block_hash)
            blocks.append(block)
        if not blocks:
            return 0
        num_tokens = len(blocks) * BLOCK_SIZE
        index = torch.tensor(blocks, device=self._keys[0].device)
        for pool, slot_tensor in self._pairs(cache):
            # [blocks, heads, B, dim] → [heads, blocks*B, dim]
            slot_tensor[slot, :, :num_tokens] = pool[index].transpose(0, 1).flatten(1, 2)
        self.stats.num_hit_tokens += num_tokens
        return num_tokens

    def store(self, token_ids: list[int], num_computed: int, cache: SlotKVCache, slot: int) -> None:
        """Keep the full blocks among the first ``num_computed`` tokens of ``slot`` that are new."""
        hashes = block_hashes(token_ids, min(num_computed, len(token_ids)) // BLOCK_SIZE)
        new = [(i, h) for i, h in enumerate(hashes) if h not in self._block_of]
        if not new or self.num_blocks == 0:
            return
        new = new[: self.num_blocks]
        targets = [self._allocate(h) for _, h in new]
        positions = torch.tensor(
            [i * BLOCK_SIZE + offset for i, _ in new for offset in range(BLOCK_SIZE)], device=self._keys[0].device
        )
        index = torch.tensor(targets, device=self._keys[0].device)
        for pool, slot_tensor in self._pairs(cache):
            # [heads, blocks*B, dim] → [blocks, heads, B, dim]
            chunk = slot_tensor[slot, :, positions]
            pool[index] = chunk.unflatten(1, (len(new), BLOCK_SIZE)).transpose(0, 1)

    def _allocate(self, block_hash: int) -> int:
        if self._free:
            block = self._free.pop()
        else:
            _, block = self._block_of.popitem(last=False)
            self.evictions += 1
        self._block_of[block_hash] = block
        return block

    def _pairs(self, cache: SlotKVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [*zip(self._keys, cache.keys, strict=True), *zip(self._values, cache.values, strict=True)]
