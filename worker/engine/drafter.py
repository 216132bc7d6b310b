"""Draft tokens without a draft model: prompt lookup over a sequence's own tokens.

An answer that edits, quotes or summarises its prompt repeats long spans of it. When the last
``n`` tokens of a sequence (prompt and output) occurred before, the tokens that followed them
then are a guess at what follows now. The engine verifies such a guess in one forward (every
drafted token is an extra query row of the step) and keeps the drafted tokens only up to the
first one the sampler would not have picked itself (``engine.py``), so a guess changes the speed,
never the text.

How far a sequence drafts adapts to how its guesses fare: a draft taken whole doubles the next
one (a copied span goes on), a partly taken one sets it to what was taken plus one, and a
sequence whose guesses keep failing stops drafting for a while, longer each time, so
open-ended text never pays for it. Measured on the default model, one stream, an edit of a
40-line file (``bench/speculative_bench.py``'s): doubling and at most 16 beat adding one, and
at most 8 or 24, by 3-10 %.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

# Longest and shortest n-gram looked up: a longer match predicts better, a shorter one more often.
NGRAM_MAX = 4
NGRAM_MIN = 2
DRAFT_MAX = 16  # tokens drafted at most per step
_DRAFT_FIRST = 4
_DRAFT_MIN = 2
# Drafts in a row that yielded nothing before a sequence pauses drafting, and the pauses (steps).
_MISSES_TO_PAUSE = 3
_PAUSE_FIRST = 4
_PAUSE_MAX = 256


class Drafter(Protocol):
    def propose(self, tokens: Seq[int], state: DraftState, limit: int) -> list[int]:
        """Up to ``limit`` tokens guessed to follow ``tokens`` (a sequence's prompt and output)."""
        ...


class DraftState:
    """One sequence's drafting: its n-gram index over its own tokens, and how its drafts fared."""

    __slots__ = ("_index", "_indexed_to", "_misses", "_pause", "_paused_for", "draft_len")

    def __init__(self) -> None:
        # An n-gram's hash -> where its latest occurrence ends (exclusive), for the n-grams ending
        # before ``_indexed_to``. Hashes, not the n-grams, are kept: a collision only makes a
        # guess that verification turns down.
        self._index: dict[int, int] = {}
        self._indexed_to = 0
        self.draft_len = _DRAFT_FIRST
        self._misses = 0
        self._pause = _PAUSE_FIRST
        self._paused_for = 0

    def wants_draft(self) -> bool:
        """Whether the sequence drafts this step (a paused one counts its pause down instead)."""
        if self._paused_for > 0:
            self._paused_for -= 1
            return False
        return True

    def lookup(self, tokens: Seq[int], limit: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix found (n from
        ``NGRAM_MAX`` down to ``NGRAM_MIN``), at most ``limit`` tokens."""
        end = len(tokens)
        for stop in range(max(self._indexed_to, NGRAM_MIN), end):  # n-grams ending before the suffix's own end
            for n in range(NGRAM_MIN, min(NGRAM_MAX, stop) + 1):
                self._index[hash(tuple(tokens[stop - n : stop]))] = stop
        self._indexed_to = max(self._indexed_to, end)
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            found = self._index.get(hash(tuple(tokens[end - n :])))
            if found is not None and found < end:
                return list(tokens[found : min(found + limit, end)])
        return []

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """How the last draft fared: the next one's length, or a pause after repeated misses."""
        if num_accepted == num_drafted:
            self.draft_len = min(DRAFT_MAX, self.draft_len * 2)
        else:
            self.draft_len = max(_DRAFT_MIN, num_accepted + 1)
        if num_accepted:
            self._misses = 0
            self._pause = _PAUSE_FIRST
            return
        self._misses += 1
        if self._misses >= _MISSES_TO_PAUSE:
            self._misses = 0
            self._paused_for = self._pause
            self._pause = min(_PAUSE_MAX, self._pause * 2)


class PromptLookup:
    """The n-gram drafter (``--speculative ngram``)."""

    def propose(self, tokens: Seq[int], state: DraftState, limit: int) -> list[int]:
        if not state.wants_draft():
            return []
        return state.lookup(tokens, min(limit, state.draft_len))
