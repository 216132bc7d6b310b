"""Which placement keys an engine holds (held_prefixes.py), over a cache whose contents the test
sets: a running job's keys are held; an ended job's while the cache holds at least half of its
prompt; a key is released once no job holds it, with the latest claim that named it."""

from __future__ import annotations

from tests.worker.engine_helpers import CharDecoder
from worker.engine.held_prefixes import HeldPrefixes
from worker.engine.prefixes import NoPrefixes
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import EngineRequest, PrefixKeys, Sequence


class Blocks(NoPrefixes):
    """A prefix cache reduced to the blocks it holds: a prompt's mark is its tokens, one per block."""

    def __init__(self) -> None:
        super().__init__()
        self.cached: set[int] = set()

    def evict(self, *blocks: int) -> None:
        self.cached -= set(blocks)
        self.evictions += 1

    def mark(self, seq: Sequence) -> list[int]:
        return list(seq.prompt_token_ids)

    def cached_blocks(self, mark: list[int]) -> int:
        return next((index for index, block in enumerate(mark) if block not in self.cached), len(mark))


def _request(request_id: str, blocks: list[int], keys: tuple[str, ...], claimed_ms: int) -> EngineRequest:
    request = EngineRequest(request_id, [blocks], SamplingParams(), prefix_keys=PrefixKeys(keys, claimed_ms))
    request.sequences.append(Sequence(request, 0, blocks, CharDecoder()))
    return request


def test_a_running_jobs_keys_are_held_and_an_ended_one_keeps_them_while_its_prompt_is_cached() -> None:
    cache = Blocks()
    held = HeldPrefixes(cache)
    turn1 = _request("t1", [1, 2, 3, 4], ("s", "s1"), claimed_ms=100)
    held.started(turn1)
    assert held.num_keys == 2 and held.released() == []
    cache.cached |= {1, 2, 3, 4}
    held.ended(turn1)
    assert held.released() == [] and held.num_keys == 2
    cache.evict(4, 3)  # half of it is left: still worth coming back to
    assert held.released() == []
    cache.evict(2)
    assert held.released() == [("s", 100), ("s1", 100)]
    assert held.num_keys == 0


def test_a_key_that_another_job_names_stays_held_and_leaves_with_the_latest_claim() -> None:
    cache = Blocks()
    held = HeldPrefixes(cache)
    turn1, turn2 = _request("t1", [1, 2], ("s", "s1"), 100), _request("t2", [1, 2, 5, 6], ("s", "s1", "s2"), 200)
    cache.cached |= {1, 2}
    held.started(turn1)
    held.ended(turn1)
    held.started(turn2)
    cache.evict(1, 2)
    assert held.released() == []  # turn 2 runs: its conversation is here
    held.ended(turn2)  # its prompt is not cached (no room): nothing of it is held
    assert sorted(held.released()) == [("s", 200), ("s1", 200), ("s2", 200)]


def test_an_ended_job_with_nothing_cached_releases_its_keys_at_once_and_the_oldest_go_past_the_bound() -> None:
    cache = Blocks()
    held = HeldPrefixes(cache, max_ended=2)
    lone = _request("lone", [9], ("x",), 50)
    held.started(lone)
    held.ended(lone)
    assert held.released() == [("x", 50)]
    cache.cached |= {1, 2, 3}
    for index, block in enumerate((1, 2, 3)):
        request = _request(f"r{index}", [block], (f"k{index}",), 10 + index)
        held.started(request)
        held.ended(request)
    assert held.released() == [("k0", 10)]
    assert held.num_keys == 2


def test_a_job_without_keys_holds_nothing() -> None:
    held = HeldPrefixes(Blocks())
    request = EngineRequest("plain", [[1]], SamplingParams())
    held.started(request)
    held.ended(request)
    assert held.num_keys == 0 and held.released() == []
