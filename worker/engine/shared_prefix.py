"""Prompt prefixes held once, however many sequences read them: prefix caching for the native
decoder on the CPU.

Agents and batch jobs send the same long system prompt and tool list with every request. A
prefix slot (``worker/native/kv_cache.py``) holds one chain of full blocks (32 tokens, or a KV
block where that is longer) from position 0, named
block by block by chained hashes (``prefix_cache.extend_block_hashes``). A new sequence attaches to the
longest cached chain its prompt begins with: it reads those positions from the prefix slot
(``worker/native/shared_attention.py``) and holds only its own tokens after them, so 32
requests sharing a 2,000-token system prompt hold it once.

Reading a prefix from its slot pays when several rows read it: one attention over it serves them
all. A row that reads a prefix alone gains nothing from the split and pays a second attention and
a merge in every layer, so before each step a lone reader takes a copy of its prefix into its
own slot and holds it itself (the prefix cache as it was before; 32 agent sessions each with
their own history run this way). Later sequences with the same prefix read the prefix slot.

Chains are published from sequences' own slots: when a prompt is computed, and when a sequence
finishes (so an agent's next turn finds it), its new full blocks extend the chain it came from
when it is at that chain's end (a reader hands the blocks over and reads them from then on), or
else go to a new prefix slot; a reader that branched off inside a chain leaves a copy of its
whole chain when it finishes, for its own next turn.

Memory: a prefix that sequences read is charged once to the KV budget (the scheduler's); one
that none reads is cached in the prefix-cache budget (``--prefix-cache-memory-gib``) and evicted
least-recently-used when that is full or its slot is wanted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from worker.engine.kv_blocks import KVBlockBudget
from worker.engine.prefix_cache import BLOCK_SIZE, PrefixCacheStats, extend_block_hashes
from worker.engine.prefix_state import PrefixSlot
from worker.engine.sequence import Sequence
from worker.native.kv_cache import SlotKVCache


@dataclass(frozen=True)
class PrefixMatch:
    prefix: PrefixSlot
    length: int  # tokens of the prompt it holds


class SharedPrefixes:
    """The ``shared`` prefix policy (``prefixes.Prefixes``)."""

    def __init__(self, cache: SlotKVCache, kv_budget: KVBlockBudget, idle_blocks: int) -> None:
        # A chain's blocks end on KV block boundaries, so a prefix hands whole blocks over.
        self.block_size = math.lcm(BLOCK_SIZE, kv_budget.block_tokens)
        self.cache = cache
        self.kv = kv_budget
        self.idle = KVBlockBudget(max(1, idle_blocks), kv_budget.block_tokens)
        self._prefixes = [PrefixSlot(cache.first_prefix_slot + i) for i in range(cache.num_prefix_slots)]
        self._holders: dict[int, list[PrefixSlot]] = {}  # block hash → prefixes whose chain has it
        self._clock = 0
        self.stats = PrefixCacheStats()
        self.evictions = 0

    @property
    def num_shared_blocks(self) -> int:
        """Blocks of prefixes that running sequences read (each charged once)."""
        return sum(prefix.num_kv_blocks for prefix in self._prefixes if prefix.num_refs)

    @property
    def num_chain_blocks(self) -> int:
        """Blocks of every cached chain, read or not."""
        return sum(prefix.num_kv_blocks for prefix in self._prefixes)

    @property
    def num_cached_chains(self) -> int:
        return sum(prefix.num_tokens > 0 for prefix in self._prefixes)

    @property
    def idle_blocks(self) -> int:
        return self.idle.num_blocks

    # -- admission ------------------------------------------------------------------------------
    def reserve(self, seq: Sequence, budget: KVBlockBudget) -> bool:
        """Attach ``seq`` to the longest chain its prompt begins with, where its own tokens and
        (when none reads it yet) the chain fit ``budget``; in order: a long prompt that does not
        fit is not overtaken by every short one after it."""
        match = self.match(seq)
        if not budget.can_take(self.admission_blocks(seq, match)):
            return False
        self.attach(seq, match)
        return True

    def fill(self, seq: Sequence, slot: int) -> int:
        return seq.prefix.shared_len  # attached before admission, read in place

    def match(self, seq: Sequence) -> PrefixMatch | None:
        """The longest cached chain ``seq``'s prefill begins with, leaving a token to compute."""
        tokens = seq.sched.prefill_token_ids
        hashes = self._hashes(seq, tokens, (len(tokens) - 1) // self.block_size)
        for index in range(len(hashes) - 1, -1, -1):
            holders = self._holders.get(hashes[index])
            if holders:
                prefix = max(holders, key=lambda holder: (holder.num_refs > 0, holder.last_used))
                return PrefixMatch(prefix, (index + 1) * self.block_size)
        return None

    def admission_blocks(self, seq: Sequence, match: PrefixMatch | None) -> int:
        """KV blocks admitting ``seq`` takes: its own tokens past the match, plus the matched
        prefix's when no running sequence reads it yet."""
        if match is None:
            return self.kv.blocks_for(seq.sched.num_prefill_tokens + 1)
        blocks = self.kv.blocks_for(seq.sched.num_prefill_tokens + 1 - match.length)
        if match.prefix.num_refs == 0:
            blocks += match.prefix.num_kv_blocks
        return blocks

    def attach(self, seq: Sequence, match: PrefixMatch | None) -> None:
        """``seq`` is admitted: it reads ``match``'s prefix instead of computing and holding it."""
        self.stats.num_queried_tokens += seq.sched.num_prefill_tokens
        if match is None:
            return
        self.stats.num_hit_tokens += match.length
        self._reference(match.prefix)
        seq.prefix.shared, seq.prefix.shared_len = match.prefix, match.length
        self._set_seq_chain(seq, match.prefix, match.length)

    def leave(self, seq: Sequence) -> None:
        """``seq`` left (finished, aborted or preempted)."""
        prefix = seq.prefix.shared
        if prefix is None:
            return
        seq.prefix.shared, seq.prefix.shared_len = None, 0
        prefix.num_refs -= 1
        if prefix.num_refs == 0:
            self.kv.free(prefix)
            self._park(prefix)

    def mark(self, seq: Sequence) -> list[int]:
        tokens = seq.prompt_token_ids
        return list(self._hashes(seq, tokens, len(tokens) // self.block_size))

    def cached_blocks(self, mark: list[int]) -> int:
        """A chain holds every block before its last: the longest block held is what counts."""
        for index in range(len(mark) - 1, -1, -1):
            if self._holders.get(mark[index]):
                return index + 1
        return 0

    # -- publishing -----------------------------------------------------------------------------
    def balance(self, running: list[Sequence]) -> None:
        """Before a step, so that every prefix read from a prefix slot is read by several rows: a
        running sequence that holds its own copy of a chain that others read reads it instead,
        at the longest length they read (its copy of those blocks is given back); then a row
        that alone reads its prefix at its length takes a copy into its own slot."""
        groups: dict[tuple[PrefixSlot, int], list[Sequence]] = {}
        for seq in running:
            if seq.prefix.shared is not None:
                groups.setdefault((seq.prefix.shared, seq.prefix.shared_len), []).append(seq)
        for seq in running:
            chain = seq.prefix.chain
            if seq.prefix.shared is not None or seq.sched.slot is None or chain is None or not chain.num_refs:
                continue
            lengths = [length for prefix, length in groups if prefix is chain and length <= seq.prefix.chain_len]
            if not lengths or not self._holds(chain, seq):
                continue
            length = max(lengths)
            self._reference(chain)
            self.kv.shrink(seq.sched, length // self.kv.block_tokens)
            seq.prefix.shared, seq.prefix.shared_len = chain, length
            self.cache.hold(seq.sched.slot, seq.sched.num_kv_blocks, length)
            groups[(chain, length)].append(seq)
        for (prefix, length), readers in groups.items():
            if len(readers) > 1:
                continue
            [seq] = readers
            extra = length // self.kv.block_tokens
            if seq.sched.slot is None or (prefix.num_refs > 1 and not self.kv.can_take(extra)):
                continue
            self.cache.copy_positions(prefix.slot, seq.sched.slot, 0, length)
            own_tokens = seq.sched.num_kv_blocks * self.kv.block_tokens
            self.leave(seq)  # frees the prefix's charge when no other row reads it
            self.kv.grow(seq.sched, length + own_tokens)
            self.cache.hold(seq.sched.slot, seq.sched.num_kv_blocks)
            self._set_seq_chain(seq, prefix if prefix.num_tokens else None, length)

    def remember(self, seq: Sequence, tokens: list[int], num_computed: int, finishing: bool) -> None:
        """Offer the full blocks among the first ``num_computed`` of ``tokens`` (``seq``'s prompt,
        and at the end its output)."""
        end = min(num_computed, len(tokens)) // self.block_size * self.block_size
        if seq.sched.slot is None or end <= seq.prefix.shared_len:
            return
        hashes = self._hashes(seq, tokens, end // self.block_size)
        chain = seq.prefix.chain if seq.prefix.chain is not None and self._holds(seq.prefix.chain, seq) else None
        if chain is not None:
            num_chain_blocks = len(chain.hashes)
            if len(hashes) <= num_chain_blocks:
                if chain.hashes[len(hashes) - 1] == hashes[-1]:
                    return  # the chain holds these tokens already
            elif chain.hashes[-1] == hashes[num_chain_blocks - 1]:
                self._extend(chain, seq, hashes, end, hand_over=seq.prefix.shared is chain)
                return
            if not finishing:
                return  # it branched off inside the chain: its own chain is left when it finishes
            if seq.prefix.shared is not None:
                self._publish_copy(seq, hashes, end)
                return
        target = self._take_empty_slot()
        if target is not None:
            self._extend(target, seq, hashes, end, hand_over=False)

    def _extend(self, chain: PrefixSlot, seq: Sequence, hashes: list[int], end: int, hand_over: bool) -> None:
        """Positions ``[chain.num_tokens, end)`` of ``seq``'s slot extend ``chain`` (``seq``'s tokens
        begin with it). ``hand_over``: ``seq`` reads ``chain`` and hands it its blocks (the KV
        budget charges them once either way); otherwise it keeps its own, and an unread chain
        grows in the idle budget."""
        assert seq.sched.slot is not None
        extra = self.kv.blocks_for(end) - chain.num_kv_blocks
        if not hand_over:
            budget_has_room = self.kv.can_take(extra) if chain.num_refs else self._make_idle_room(extra, keep=chain)
            if not budget_has_room:
                return
        self.cache.copy_positions(seq.sched.slot, chain.slot, chain.num_tokens, end)
        if hand_over:
            self.kv.shrink(seq.sched, (end - seq.prefix.shared_len) // self.kv.block_tokens)
        (self.kv if chain.num_refs else self.idle).grow(chain, end)
        self._set_chain(chain, hashes, end)
        self._set_seq_chain(seq, chain, end)
        if hand_over:
            seq.prefix.shared_len = end
            self.cache.hold(seq.sched.slot, seq.sched.num_kv_blocks, end)

    def _publish_copy(self, seq: Sequence, hashes: list[int], end: int) -> None:
        """A finishing reader's whole chain (its prefix's part, then its own) into a new prefix
        slot that nobody reads yet, within the idle budget."""
        source = seq.prefix.shared
        assert source is not None and seq.sched.slot is not None
        target = self._take_empty_slot()
        if target is None or not self._make_idle_room(self.kv.blocks_for(end), keep=source):
            return
        self.cache.copy_positions(source.slot, target.slot, 0, seq.prefix.shared_len)
        self.cache.copy_positions(seq.sched.slot, target.slot, seq.prefix.shared_len, end)
        self.idle.grow(target, end)
        self._set_chain(target, hashes, end)

    # -- bookkeeping ----------------------------------------------------------------------------
    def _reference(self, prefix: PrefixSlot) -> None:
        if prefix.num_refs == 0:  # from the idle budget to the KV budget
            self.idle.free(prefix)
            self.kv.grow(prefix, prefix.num_tokens)
        prefix.num_refs += 1
        self._touch(prefix)

    def _park(self, prefix: PrefixSlot) -> None:
        """Nobody reads ``prefix`` any more: keep it in the idle budget, evicting older idle
        prefixes, or drop it when it cannot fit."""
        if self._make_idle_room(self.kv.blocks_for(prefix.num_tokens), keep=prefix):
            self.idle.grow(prefix, prefix.num_tokens)
        else:
            self._drop(prefix)

    def _make_idle_room(self, num_blocks: int, keep: PrefixSlot) -> bool:
        while self.idle.num_free < num_blocks:
            idle = [prefix for prefix in self._prefixes if prefix.num_kv_blocks and not prefix.num_refs]
            victims = [prefix for prefix in idle if prefix is not keep]
            if not victims:
                return False
            self._evict(min(victims, key=lambda prefix: prefix.last_used))
        return True

    def _take_empty_slot(self) -> PrefixSlot | None:
        """An empty prefix slot, evicting the least recently used idle prefix if none is."""
        unread = [prefix for prefix in self._prefixes if not prefix.num_refs]
        empty = [prefix for prefix in unread if not prefix.num_tokens]
        if empty:
            return empty[0]
        if not unread:
            return None
        victim = min(unread, key=lambda prefix: prefix.last_used)
        self._evict(victim)
        return victim

    def _set_chain(self, prefix: PrefixSlot, hashes: list[int], num_tokens: int) -> None:
        """``prefix`` now holds the chain ``hashes`` (its old chain, if any, is a start of it)."""
        for block_hash in hashes[len(prefix.hashes) :]:
            self._holders.setdefault(block_hash, []).append(prefix)
        prefix.hashes, prefix.num_tokens = hashes, num_tokens
        self.cache.hold(prefix.slot, self.kv.blocks_for(num_tokens))
        self._touch(prefix)

    def _evict(self, prefix: PrefixSlot) -> None:
        """An unread prefix leaves the idle budget and the cache."""
        self.idle.free(prefix)
        self._drop(prefix)

    def _drop(self, prefix: PrefixSlot) -> None:
        """Forget ``prefix``'s chain; its slot's pages go back when the cache is trimmed."""
        self.evictions += 1
        for block_hash in prefix.hashes:
            holders = self._holders[block_hash]
            holders.remove(prefix)
            if not holders:
                del self._holders[block_hash]
        prefix.hashes, prefix.num_tokens = [], 0
        self.cache.vacate(prefix.slot)

    def _set_seq_chain(self, seq: Sequence, chain: PrefixSlot | None, length: int) -> None:
        seq.prefix.chain, seq.prefix.chain_len = (chain, length) if chain is not None else (None, 0)
        seq.prefix.chain_hash = chain.hashes[length // self.block_size - 1] if chain is not None and length else 0

    def _holds(self, chain: PrefixSlot, seq: Sequence) -> bool:
        """Whether ``chain`` still begins with ``seq``'s first ``seq.prefix.chain_len`` tokens."""
        index = seq.prefix.chain_len // self.block_size - 1
        return 0 <= index < len(chain.hashes) and chain.hashes[index] == seq.prefix.chain_hash

    def _hashes(self, seq: Sequence, tokens: list[int], num_blocks: int) -> list[int]:
        """The chained hashes of ``tokens``' first ``num_blocks`` blocks; ``tokens`` are ``seq``'s
        (prompt, then outputs), so the hashes it already has stay valid and only new blocks are hashed."""
        extend_block_hashes(seq.prefix.block_hashes, seq.cache_keys(tokens), num_blocks, self.block_size)
        return seq.prefix.block_hashes[:num_blocks]

    def _touch(self, prefix: PrefixSlot) -> None:
        self._clock += 1
        prefix.last_used = self._clock
