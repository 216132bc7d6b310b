"""What the engine does with the prompt prefixes it computed before, behind one interface.

The plan's ``prefix_policy`` picks one implementation at build time, and the scheduler and
engine call only this interface:

- ``shared``: ``SharedPrefixes`` (``shared_prefix.py``), a prefix held once in a prefix slot and
  read in place by every sequence that begins with it;
- ``copy``: ``PrefixCache`` (``prefix_cache.py``), a prefix's blocks copied into each slot that
  begins with it (the exact numerics read one contiguous row);
- ``off``: ``NoPrefixes``, every prompt computed whole.
"""

from __future__ import annotations

from typing import Protocol

from worker.engine.kv_blocks import KVBlockBudget
from worker.engine.prefix_cache import PrefixCacheStats
from worker.engine.sequence import Sequence


class Prefixes(Protocol):
    stats: PrefixCacheStats  # prompt tokens asked for and found, for the registry's hit rate
    evictions: int  # cached prefixes dropped so far: what is held is worth checking again when it moves

    @property
    def idle_blocks(self) -> int:
        """KV blocks of cached prefixes that no running sequence reads (kept when memory is trimmed)."""
        ...

    def reserve(self, seq: Sequence, budget: KVBlockBudget) -> bool:
        """Whether ``seq`` fits the KV budget now; where it does, it is charged for what it will
        hold (a shared prefix it begins with is attached here, and charged once)."""
        ...

    def fill(self, seq: Sequence, slot: int) -> int:
        """``seq`` was admitted to ``slot``: how many of its prefill tokens are already computed."""
        ...

    def balance(self, running: list[Sequence]) -> None:
        """Before each step: rearrange who reads which prefix (sharing only)."""
        ...

    def leave(self, seq: Sequence) -> None:
        """``seq`` left the running batch (finished, aborted or preempted)."""
        ...

    def remember(self, seq: Sequence, tokens: list[int], num_computed: int, finishing: bool) -> None:
        """Offer the first ``num_computed`` of ``tokens`` (``seq``'s prompt, then its output) for
        later prompts: when its prompt is computed, and when it finishes."""
        ...

    def mark(self, seq: Sequence) -> list[int]:
        """What names ``seq``'s prompt in this cache: the hashes of its full blocks."""
        ...

    def cached_blocks(self, mark: list[int]) -> int:
        """How many leading blocks of the prompt ``mark`` names the cache holds now."""
        ...


class NoPrefixes:
    """No prefix cache: every prompt is computed whole."""

    def __init__(self) -> None:
        self.stats = PrefixCacheStats()
        self.evictions = 0

    @property
    def idle_blocks(self) -> int:
        return 0

    def reserve(self, seq: Sequence, budget: KVBlockBudget) -> bool:
        return budget.can_admit(seq.sched.num_prefill_tokens + 1)

    def fill(self, seq: Sequence, slot: int) -> int:
        return 0

    def balance(self, running: list[Sequence]) -> None:
        pass

    def leave(self, seq: Sequence) -> None:
        pass

    def remember(self, seq: Sequence, tokens: list[int], num_computed: int, finishing: bool) -> None:
        pass

    def mark(self, seq: Sequence) -> list[int]:
        return []

    def cached_blocks(self, mark: list[int]) -> int:
        return 0
