"""Which placement keys this engine holds: those of the jobs it runs, and of the jobs it ran whose
prompts its prefix cache still holds.

The claim (``shared.job_lifecycle``) records a job's prefix keys (``shared.placement``) in the
worker's held set when the worker takes the job, so that the conversation's next turn is placed
on it. This is the other half: a key leaves the held set when no running job names it and the
prompts of the ended jobs that named it have left the prefix cache (evicted, or never stored:
no room, or prefix caching off). A key is then reported once with the latest claim time of the
jobs that named it, so that the worker's process removes it only if no newer claim has
recorded it again meanwhile.

Owned by the engine loop's thread, like the prefix cache it reads.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from worker.engine.prefixes import Prefixes
from worker.engine.sequence import EngineRequest, PrefixKeys

MAX_ENDED = 512
"""Ended jobs followed at most; the oldest is let go (its keys reported) past this."""
HELD_SHARE = 0.5
"""An ended job's keys are held while the cache holds at least this share of its prompt's full blocks."""


@dataclass(frozen=True)
class _Ended:
    keys: PrefixKeys
    mark: list[int]  # its prompt's block hashes, as the cache names them


class HeldPrefixes:
    def __init__(self, prefixes: Prefixes, max_ended: int = MAX_ENDED) -> None:
        self._prefixes = prefixes
        self._max_ended = max_ended
        self._refs: Counter[str] = Counter()  # key → running and held ended jobs that name it
        self._claimed_ms: dict[str, int] = {}  # key → the latest claim of a job that named it
        self._ended: OrderedDict[str, _Ended] = OrderedDict()  # request id → held ended job, oldest first
        self._released: list[tuple[str, int]] = []
        self._checked_at_evictions = 0

    @property
    def num_keys(self) -> int:
        return len(self._refs)

    def started(self, request: EngineRequest) -> None:
        """``request`` entered the engine: its keys are held while it runs."""
        earlier = self._ended.pop(request.request_id, None)
        if earlier is not None:
            self._release(earlier.keys)
        if request.prefix_keys is None:
            return
        for key in request.prefix_keys.keys:
            self._refs[key] += 1
            self._claimed_ms[key] = max(self._claimed_ms.get(key, 0), request.prefix_keys.claimed_ms)

    def ended(self, request: EngineRequest) -> None:
        """``request`` left the engine (finished, aborted, replaced): its keys stay held while the
        cache holds its prompt."""
        keys = request.prefix_keys
        if keys is None:
            return
        mark = self._prefixes.mark(request.sequences[0]) if request.sequences else []
        if not self._holds(mark):
            self._release(keys)
            return
        self._ended[request.request_id] = _Ended(keys, mark)
        while len(self._ended) > self._max_ended:
            _, oldest = self._ended.popitem(last=False)
            self._release(oldest.keys)

    def released(self) -> list[tuple[str, int]]:
        """Keys held no more since the last call, each with the latest claim that named it. Checks
        the ended jobs' prompts again when the cache evicted something since the last check."""
        evictions = self._prefixes.evictions
        if evictions != self._checked_at_evictions:
            self._checked_at_evictions = evictions
            for request_id, ended in list(self._ended.items()):
                if not self._holds(ended.mark):
                    del self._ended[request_id]
                    self._release(ended.keys)
        released, self._released = self._released, []
        return [(key, claimed_ms) for key, claimed_ms in released if key not in self._refs]  # not named again

    def _holds(self, mark: list[int]) -> bool:
        return bool(mark) and self._prefixes.cached_blocks(mark) >= HELD_SHARE * len(mark)

    def _release(self, keys: PrefixKeys) -> None:
        for key in keys.keys:
            self._refs[key] -= 1
            if self._refs[key] <= 0:
                del self._refs[key]
                self._released.append((key, self._claimed_ms.pop(key, keys.claimed_ms)))
