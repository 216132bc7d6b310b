"""Prefixes held once (shared_prefix.py, shared_attention.py) on the tiny random Llama through
the native decoder (fp32): rows that read a shared prefix get the logits of their whole
sequence; through the engine, requests sharing a system prompt hold it once, give the tokens
they give without sharing, survive preemption, and cache finished turns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from shared.events import DeltaEvent
from tests.worker.engine_helpers import RunnerSeq
from tests.worker.test_engine import Collector
from worker.engine.builder import EngineConfig, build_engine
from worker.engine.engine import LLMEngine
from worker.engine.model_runner import ModelRunner
from worker.engine.prefix_cache import block_hashes, extend_block_hashes
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import PrefillChunk
from worker.engine.scheduling_state import SequenceStatus
from worker.engine.sequence import EngineRequest
from worker.engine.shared_prefix import SharedPrefixes
from worker.models.loader import LoadedModel, load_model
from worker.native.decoder import NativeCausalLM
from worker.native.kv_cache import KVCacheLayout, SlotKVCache, is_lazily_backed

pytestmark = pytest.mark.skipif(not is_lazily_backed(torch.device("cpu")), reason="needs madvise (Linux)")

MAX_LEN = 2304
CHAIN = 64  # the tiny model's chain block: lcm(32, a 4 KiB page of one fp32 16-wide head)


@pytest.fixture(scope="module")
def native(tiny_model_path: Path) -> LoadedModel:
    loaded = load_model(str(tiny_model_path), Path("/nonexistent"), "cpu", "float32", None, model_impl="native")
    assert isinstance(loaded.model, NativeCausalLM)
    return loaded


def test_rows_reading_a_shared_prefix_get_the_logits_of_their_whole_sequence(
    native: LoadedModel, tiny_model_path: Path
) -> None:
    model = native.model
    layout = KVCacheLayout.from_config(model.config, torch.float32, torch.device("cpu"))
    cache = SlotKVCache(layout, 4, 256, num_prefix_slots=1)
    runner = ModelRunner(model, cache)
    generator = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 1000, (CHAIN,), generator=generator).tolist()
    tails = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (9, 5, 12, 6)]
    prompts = [prefix + tails[0], prefix + tails[1], tails[2], prefix + tails[3]]
    pslot = cache.first_prefix_slot
    # Row 0 computes the prefix in its own slot; the prefix slot gets a copy of it.
    owner = RunnerSeq(prompts[0], 0)
    runner.prefill([PrefillChunk(owner, 0, len(prompts[0]))])  # type: ignore[arg-type]
    cache.copy_positions(0, pslot, 0, CHAIN)
    # Rows 1 and 3 read it (one group) beside row 2, which has no prefix, in one prefill step.
    seqs = [
        owner,
        RunnerSeq(prompts[1], 1, pslot, CHAIN),
        RunnerSeq(prompts[2], 2),
        RunnerSeq(prompts[3], 3, pslot, CHAIN),
    ]
    chunks = [PrefillChunk(seqs[1], CHAIN, 5), PrefillChunk(seqs[2], 0, 12), PrefillChunk(seqs[3], CHAIN, 6)]
    last = runner.prefill(chunks)  # type: ignore[arg-type]
    steps = {1: [last[0]], 2: [last[1]], 3: [last[2]]}
    nexts = [[7, 9, 11, 13], [3, 5, 8, 2]]
    for step, tokens in enumerate(nexts):
        positions = [len(prompt) + step for prompt in prompts]
        shared = [(-1, 0), (pslot, CHAIN), (-1, 0), (pslot, CHAIN)]
        logits = runner.decode(tokens, positions, shared)
        for row in (1, 2, 3):
            steps[row].append(logits[row])
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        for row in (1, 2, 3):
            full = torch.tensor([prompts[row] + [tokens[row] for tokens in nexts]])
            expected = reference(full).logits[0, len(prompts[row]) - 1 :]
            torch.testing.assert_close(torch.stack(steps[row]), expected, atol=1e-5, rtol=1e-4)


def _engine(
    native: LoadedModel,
    *,
    sharing: bool,
    kv_tokens: int = 80_000,
    prefix_tokens: int = 8192,
    max_len: int = MAX_LEN,
) -> tuple[LLMEngine, Collector]:
    layout = KVCacheLayout.from_config(native.model.config, torch.float32, torch.device("cpu"))
    config = EngineConfig(
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=max_len,
        kv_cache_bytes=kv_tokens * layout.bytes_per_token,
        prefix_cache_bytes=prefix_tokens * layout.bytes_per_token if sharing else 0,
    )
    collector = Collector()
    engine = build_engine(native.model, native.tokenizer, config, native.eos_token_ids, collector)
    assert isinstance(engine.scheduler.prefixes, SharedPrefixes) == sharing
    return engine, collector


def _greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


def _drain(engine: LLMEngine, collector: Collector, request_ids: set[str], max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if request_ids <= collector.done:
            return
        engine.run_step()
    raise AssertionError(f"requests did not finish: {request_ids - collector.done}")


def _tokens(collector: Collector, request_id: str) -> list[object]:
    return [event.content for event in collector.events[request_id] if isinstance(event, DeltaEvent)]


SYSTEM_TOKENS = 2000


def _system_prompt_requests(native: LoadedModel, count: int, max_new: int) -> list[EngineRequest]:
    generator = torch.Generator().manual_seed(5)
    system = torch.randint(100, 20_000, (SYSTEM_TOKENS,), generator=generator).tolist()
    return [
        EngineRequest(
            f"r{i}", [system + torch.randint(100, 20_000, (20,), generator=generator).tolist()], _greedy(max_new)
        )
        for i in range(count)
    ]


def _run_after_the_first(engine: LLMEngine, collector: Collector, requests: list[EngineRequest]) -> int:
    """The first request's prompt is computed, then the rest arrive; returns the most KV blocks
    held while all of them decode."""
    engine.submit(requests[0])
    while requests[0].sequences == [] or requests[0].sequences[0].sched.status is not SequenceStatus.DECODING:
        engine.run_step()
    for request in requests[1:]:
        engine.submit(request)
    peak = 0
    while not {r.request_id for r in requests} <= collector.done:
        engine.run_step()
        if engine.num_running == len(requests):
            peak = max(peak, engine.scheduler.budget.num_used)
    return peak


def test_32_requests_sharing_a_2000_token_system_prompt_hold_it_once(native: LoadedModel) -> None:
    requests = _system_prompt_requests(native, 32, max_new=80)
    shared_engine, shared_out = _engine(native, sharing=True)
    shared_peak = _run_after_the_first(shared_engine, shared_out, requests)
    plain_requests = _system_prompt_requests(native, 32, max_new=80)
    plain_engine, plain_out = _engine(native, sharing=False)
    plain_peak = _run_after_the_first(plain_engine, plain_out, plain_requests)

    block = shared_engine.scheduler.budget.block_tokens
    system_blocks = SYSTEM_TOKENS // block
    own_blocks = -(-(SYSTEM_TOKENS % block + 20 + 80) // block)  # each request's tail, and its output
    # Without sharing every request holds the system prompt; with it, the prompt is held once.
    assert plain_peak >= 32 * system_blocks
    assert shared_peak <= system_blocks + 1 + 32 * (own_blocks + 1)
    for request in requests:
        assert _tokens(shared_out, request.request_id) == _tokens(plain_out, request.request_id)
    ends = [shared_out.events[f"r{i}"][-1] for i in range(32)]
    assert ends[0].usage.cached_tokens == 0  # type: ignore[attr-defined]
    assert all(end.usage.cached_tokens == SYSTEM_TOKENS // CHAIN * CHAIN for end in ends[1:])  # type: ignore[attr-defined]
    # Once they finished, every block is back and nothing is read; the cache keeps the chains.
    prefixes = shared_engine.scheduler.prefixes
    assert isinstance(prefixes, SharedPrefixes) and prefixes.num_shared_blocks == 0
    assert shared_engine.scheduler.budget.num_used == 0 and prefixes.num_cached_chains >= 1


def test_running_out_of_blocks_with_shared_prefixes_preempts_and_finishes_every_sequence(
    native: LoadedModel,
) -> None:
    # Six requests share a 128-token prefix; 12 blocks of 64 tokens cannot hold their outputs.
    generator = torch.Generator().manual_seed(9)
    system = torch.randint(100, 20_000, (128,), generator=generator).tolist()
    prompts = {f"p{i}": system + torch.randint(100, 20_000, (10,), generator=generator).tolist() for i in range(6)}
    engine, collector = _engine(native, sharing=True, kv_tokens=12 * CHAIN, prefix_tokens=4 * CHAIN, max_len=512)
    first = EngineRequest("p0", [prompts["p0"]], _greedy(150))
    engine.submit(first)
    engine.run_step()
    for rid, prompt in list(prompts.items())[1:]:
        engine.submit(EngineRequest(rid, [prompt], _greedy(150)))
    _drain(engine, collector, set(prompts))
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.budget.num_used == 0
    for rid, prompt in prompts.items():
        alone, alone_out = _engine(native, sharing=False, max_len=512)
        alone.submit(EngineRequest(rid, [prompt], _greedy(150)))
        _drain(alone, alone_out, {rid})
        assert collector.num_tokens(rid) == 150
        assert _tokens(collector, rid) == _tokens(alone_out, rid), rid


def test_a_finished_turn_is_read_by_the_next_turn(native: LoadedModel) -> None:
    engine, collector = _engine(native, sharing=True)
    first = list(range(200, 500))
    turn1 = EngineRequest("turn1", [first], _greedy(90))
    engine.submit(turn1)
    _drain(engine, collector, {"turn1"})
    history = first + turn1.sequences[0].output_token_ids
    engine.submit(EngineRequest("turn2", [[*history, 11, 12, 13]], _greedy(4)))
    _drain(engine, collector, {"turn2"})
    cached = collector.events["turn2"][-1].usage.cached_tokens  # type: ignore[attr-defined]
    # Every full chain block of turn 1 whose KV was computed (all but its last sampled token).
    assert cached == (len(history) - 1) // CHAIN * CHAIN


def test_a_branch_leaves_a_copy_of_its_chain_and_idle_chains_are_evicted_oldest_first(native: LoadedModel) -> None:
    engine, collector = _engine(native, sharing=True, prefix_tokens=6 * CHAIN)
    prefixes = engine.scheduler.prefixes
    assert isinstance(prefixes, SharedPrefixes)
    trunk = list(range(300, 300 + 2 * CHAIN))
    engine.submit(EngineRequest("a", [trunk + [1] * CHAIN + [2]], _greedy(1)))
    _drain(engine, collector, {"a"})
    # "b" branches off after the trunk: it reads the trunk from "a"'s chain, and leaves its own.
    engine.submit(EngineRequest("b", [trunk + [3] * CHAIN + [4]], _greedy(1)))
    _drain(engine, collector, {"b"})
    assert collector.events["b"][-1].usage.cached_tokens == 2 * CHAIN  # type: ignore[attr-defined]
    assert prefixes.num_cached_chains == 2
    engine.submit(EngineRequest("b2", [trunk + [3] * CHAIN + [5]], _greedy(1)))
    _drain(engine, collector, {"b2"})
    assert collector.events["b2"][-1].usage.cached_tokens == 3 * CHAIN  # type: ignore[attr-defined]
    # A third chain of 3 blocks does not fit beside two (6 blocks idle): the oldest used goes.
    engine.submit(EngineRequest("c", [[*range(900, 900 + 3 * CHAIN), 6]], _greedy(1)))
    _drain(engine, collector, {"c"})
    assert prefixes.num_cached_chains == 2
    engine.submit(EngineRequest("a2", [trunk + [1] * CHAIN + [7]], _greedy(1)))
    _drain(engine, collector, {"a2"})
    assert collector.events["a2"][-1].usage.cached_tokens == 2 * CHAIN  # type: ignore[attr-defined]
    assert engine.scheduler.budget.num_used == 0 and prefixes.num_shared_blocks == 0


def test_sessions_each_with_their_own_history_copy_it_and_read_no_prefix_slot(native: LoadedModel) -> None:
    # Four agent sessions, each with its own history: a prefix read by one row alone gains nothing
    # from the split attention, so each turn copies its own cached history into its slot.
    generator = torch.Generator().manual_seed(11)
    histories = {f"s{i}": torch.randint(100, 20_000, (300,), generator=generator).tolist() for i in range(4)}
    outputs: dict[str, dict[str, list[object]]] = {}
    for sharing in (True, False):
        engine, collector = _engine(native, sharing=sharing)
        for sid, history in histories.items():
            engine.submit(EngineRequest(f"{sid}-1", [history], _greedy(40)))
        _drain(engine, collector, {f"{sid}-1" for sid in histories})
        for sid, history in histories.items():
            engine.submit(EngineRequest(f"{sid}-2", [[*history, 7, 8, 9]], _greedy(40)))
        readers = 0
        while not {f"{sid}-2" for sid in histories} <= collector.done:
            engine.run_step()
            readers = max(readers, sum(seq.prefix.shared is not None for seq in engine.scheduler.running))
        assert readers == 0
        outputs[str(sharing)] = {rid: _tokens(collector, rid) for rid in collector.events}
        if sharing:
            cached = [collector.events[f"{sid}-2"][-1].usage.cached_tokens for sid in histories]  # type: ignore[attr-defined]
            assert cached == [300 // CHAIN * CHAIN] * 4
            assert isinstance(engine.scheduler.prefixes, SharedPrefixes)
            assert engine.scheduler.budget.num_used == 0
    assert outputs["True"] == outputs["False"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_traffic_over_shared_prefixes_keeps_the_books_and_the_text(native: LoadedModel, seed: int) -> None:
    # Prompts built from three shared starts of unequal length, arriving over time, some of them
    # the next turn of an earlier one, on a budget small enough to preempt: every request gives
    # the tokens it gives without sharing, and when all have finished no block is held and the
    # idle budget counts exactly the chains it keeps.
    rng = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=rng))

    starts = [torch.randint(100, 20_000, (n,), generator=rng).tolist() for n in (70, 200, 330)]
    arrivals: list[tuple[int, EngineRequest]] = []
    for i in range(14):
        start = starts[randint(0, 3)]
        prompt = (
            start[: randint(len(start) // 2, len(start) + 1)]
            + torch.randint(100, 20_000, (randint(1, 50),), generator=rng).tolist()
        )
        arrivals.append((randint(0, 12), EngineRequest(f"q{i}", [prompt], _greedy(randint(1, 60)))))
    texts = {}
    for sharing in (True, False):
        engine, collector = _engine(
            native, sharing=sharing, kv_tokens=10 * CHAIN, prefix_tokens=12 * CHAIN, max_len=512
        )
        pending = sorted(arrivals, key=lambda arrival: arrival[0])
        step = 0
        while pending or not {request.request_id for _, request in arrivals} <= collector.done:
            while pending and pending[0][0] <= step:
                _, request = pending.pop(0)
                engine.submit(EngineRequest(request.request_id, request.prompts, request.params))
            engine.run_step()
            step += 1
            assert step < 5000
        texts[sharing] = {request.request_id: _tokens(collector, request.request_id) for _, request in arrivals}
        assert engine.scheduler.budget.num_used == 0
        prefixes = engine.scheduler.prefixes
        assert isinstance(prefixes, SharedPrefixes) == sharing
        if isinstance(prefixes, SharedPrefixes):
            assert prefixes.num_shared_blocks == 0
            assert prefixes.idle.num_used == prefixes.num_chain_blocks
            assert prefixes.idle.num_used <= prefixes.idle.num_blocks
            assert prefixes.stats.num_hit_tokens > 0
    assert texts[True] == texts[False]


@given(
    tokens=st.lists(st.integers(0, 50), max_size=200),
    steps=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 4, 32]),
)
def test_block_hashes_extended_in_steps_equal_those_hashed_at_once(
    tokens: list[int], steps: list[int], block_size: int
) -> None:
    """A sequence keeps its block hashes and extends them as its tokens grow (the scheduler asks
    for a waiting prompt's at every step): the result is what hashing everything at once gives."""
    known: list[int] = []
    num_blocks = 0
    for step in steps:
        num_blocks = min(num_blocks + step, len(tokens) // block_size)
        extend_block_hashes(known, tokens, num_blocks, block_size)
        assert known == block_hashes(tokens, num_blocks, block_size)
