"""The batching engine in-process on the tiny random model (fp32): rows joining and leaving give
the same greedy tokens as running alone; aborts, budgets and failures behave."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.errors import ErrorKind
from shared.events import DeltaEvent, EndEvent, ErrorEvent
from worker.engine.builder import EngineConfig, build_engine
from worker.engine.engine import LLMEngine, RequestOutput
from worker.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import EngineRequest, PrefixKeys
from worker.native.kv_cache import KVCacheLayout

MAX_LEN = 256


class Collector:
    def __init__(self) -> None:
        self.events: dict[str, list[object]] = {}
        self.done: set[str] = set()

    def __call__(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self.events.setdefault(output.request_id, []).extend(output.events)
            if output.is_done:
                self.done.add(output.request_id)

    def text(self, request_id: str) -> str:
        return "".join(e.content or "" for e in self.events[request_id] if isinstance(e, DeltaEvent))

    def num_tokens(self, request_id: str) -> int:
        end = self.events[request_id][-1]
        assert isinstance(end, EndEvent)
        return end.usage.completion_tokens


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model_path)


def _engine(
    tiny: tuple[torch.nn.Module, object], *, slots: int = 8, budget: int = 64, prefix_blocks: int = 0
) -> tuple[LLMEngine, Collector]:
    model, tokenizer = tiny
    layout = KVCacheLayout.from_config(model.config, torch.float32, torch.device("cpu"))
    config = EngineConfig(
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        max_model_len=MAX_LEN,
        kv_cache_bytes=(slots + 1) * layout.bytes_per_token * MAX_LEN,
        prefix_cache_bytes=prefix_blocks * layout.bytes_per_token * BLOCK_SIZE,
    )
    collector = Collector()
    engine = build_engine(model, tokenizer, config, frozenset({tokenizer.eos_token_id}), collector)
    return engine, collector


def _prompt(tokenizer: object, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


def _greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


def _drain(engine: LLMEngine, collector: Collector, request_ids: set[str], max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if request_ids <= collector.done:
            return
        engine.run_step()
    raise AssertionError(f"requests did not finish: {request_ids - collector.done}")


PROMPTS = ["short one", "a somewhat longer prompt with more words in it", "x " * 40, "hello"]


def _solo_tokens(tiny: tuple[torch.nn.Module, object], prompt: list[int], max_new: int) -> list[int]:
    model, _ = tiny
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_joining_and_leaving_rows_match_running_alone(tiny: tuple[torch.nn.Module, object]) -> None:
    engine, collector = _engine(tiny, budget=24)
    _, tokenizer = tiny
    prompts = [_prompt(tokenizer, text) for text in PROMPTS]
    lengths = [30, 7, 19, 12]
    requests = [EngineRequest(f"r{i}", [p], _greedy(n)) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    engine.submit(requests[0])
    engine.run_step()
    engine.run_step()
    engine.submit(requests[1])  # joins while r0 decodes
    engine.run_step()
    engine.submit(requests[2])
    engine.submit(requests[3])
    _drain(engine, collector, {r.request_id for r in requests})
    for request, prompt, length in zip(requests, prompts, lengths, strict=True):
        tokens = request.sequences[0].output_token_ids
        assert tokens == _solo_tokens(tiny, prompt, length), request.request_id
        assert collector.num_tokens(request.request_id) == length
    assert engine.num_running == 0


def test_abort_removes_a_row_at_the_next_step_and_others_continue(tiny: tuple[torch.nn.Module, object]) -> None:
    engine, collector = _engine(tiny)
    _, tokenizer = tiny
    prompt = _prompt(tokenizer, PROMPTS[1])
    keep, drop = EngineRequest("keep", [prompt], _greedy(20)), EngineRequest("drop", [prompt], _greedy(200))
    engine.submit(keep)
    engine.submit(drop)
    for _ in range(4):
        engine.run_step()
    generated = len(drop.sequences[0].output_token_ids)
    engine.abort("drop")
    engine.run_step()
    assert len(drop.sequences[0].output_token_ids) == generated
    assert "drop" in collector.done and engine.num_running == 1
    assert not any(isinstance(e, ErrorEvent) for e in collector.events["drop"])
    _drain(engine, collector, {"keep"})
    assert keep.sequences[0].output_token_ids == _solo_tokens(tiny, prompt, 20)


def test_abort_with_a_kind_sends_an_error_event(tiny: tuple[torch.nn.Module, object]) -> None:
    engine, collector = _engine(tiny)
    engine.submit(EngineRequest("r", [[1, 2, 3]], _greedy(50)))
    engine.run_step()
    engine.abort("r", ErrorKind.WORKER_SHUTTING_DOWN, "bye")
    engine.run_step()
    last = collector.events["r"][-1]
    assert isinstance(last, ErrorEvent) and last.kind is ErrorKind.WORKER_SHUTTING_DOWN


def test_a_request_added_again_replaces_its_earlier_attempt_and_others_go_on(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    """A job claimed twice by one worker (a demoted primary answered a claim during a failover):
    the earlier attempt stops, the later one finishes as if alone, and no other request fails."""
    engine, collector = _engine(tiny)
    _, tokenizer = tiny
    prompt = _prompt(tokenizer, PROMPTS[1])
    other = EngineRequest("other", [prompt], _greedy(12))
    first, again = EngineRequest("job", [prompt], _greedy(6)), EngineRequest("job", [prompt], _greedy(9))
    engine.submit(other)
    engine.submit(first)
    engine.run_step()
    engine.run_step()
    engine.submit(again)
    _drain(engine, collector, {"other", "job"})
    for _ in range(20):
        engine.run_step()  # the earlier attempt is gone: nothing of it finishes later
    assert again.sequences[0].output_token_ids == _solo_tokens(tiny, prompt, 9)
    assert other.sequences[0].output_token_ids == _solo_tokens(tiny, prompt, 12)
    assert not any(isinstance(e, ErrorEvent) for events in collector.events.values() for e in events)
    assert engine.num_running == 0


def test_an_abort_names_only_the_request_submitted_before_it(tiny: tuple[torch.nn.Module, object]) -> None:
    # A job whose writes were refused is aborted after its request ended; the same job claimed
    # again later must run, not meet that stale abort.
    engine, collector = _engine(tiny)
    engine.submit(EngineRequest("job", [[1, 2, 3]], _greedy(4)))
    _drain(engine, collector, {"job"})
    engine.abort("job")
    engine.run_step()
    collector.done.discard("job")
    again = EngineRequest("job", [[1, 2, 3]], _greedy(4))
    engine.submit(again)
    _drain(engine, collector, {"job"})
    assert again.sequences[0].output_token_ids == _solo_tokens(tiny, [1, 2, 3], 4)
    assert engine.num_running == 0


def test_the_memory_budget_caps_concurrency_by_tokens(tiny: tuple[torch.nn.Module, object]) -> None:
    # A budget of 2 full-length sequences: 8 blocks of 64 tokens (fp32, 16-wide heads). Prompts of
    # 100 tokens take 2 blocks each; the admission watermark keeps 1 free, so 3 run at once.
    engine, collector = _engine(tiny, slots=1, budget=256)
    assert engine.max_running == 64 and engine.scheduler.budget.num_blocks == 8
    ids = {f"r{i}" for i in range(7)}
    for request_id in sorted(ids):
        engine.submit(EngineRequest(request_id, [list(range(5, 105))], _greedy(10)))
    peak = 0
    while not ids <= collector.done:
        engine.run_step()
        peak = max(peak, engine.num_running)
    assert peak == 3
    assert engine.scheduler.budget.num_used == 0  # every block came back


def test_short_streams_run_past_the_slot_count_the_budget_used_to_give(tiny: tuple[torch.nn.Module, object]) -> None:
    # The budget of 16 full-length slots (68 blocks): 64 short streams all run at once.
    engine, collector = _engine(tiny, slots=16, budget=256)
    ids = {f"r{i}" for i in range(64)}
    for request_id in sorted(ids):
        engine.submit(EngineRequest(request_id, [[5, 6, 7, 8]], _greedy(40)))
    peak = 0
    while not ids <= collector.done:
        engine.run_step()
        peak = max(peak, engine.num_running)
    assert peak == 64


def test_a_long_prompt_runs_alongside_32_short_streams(tiny: tuple[torch.nn.Module, object]) -> None:
    # The budget of 16 full-length slots: a prompt of 200 of the 256 positions and 32 short streams.
    engine, collector = _engine(tiny, slots=16, budget=256)
    engine.submit(EngineRequest("long", [list(range(3, 203))], _greedy(20)))
    for i in range(32):
        engine.submit(EngineRequest(f"s{i}", [[5, 6, 7, 8]], _greedy(20)))
    peak = 0
    while not {"long", *(f"s{i}" for i in range(32))} <= collector.done:
        engine.run_step()
        peak = max(peak, engine.num_running)
    assert peak == 33
    assert collector.num_tokens("long") == 20


def _text_alone(tiny: tuple[torch.nn.Module, object], prompt: list[int], params: SamplingParams) -> str:
    engine, collector = _engine(tiny)
    engine.submit(EngineRequest("alone", [prompt], params))
    _drain(engine, collector, {"alone"})
    return collector.text("alone")


def test_running_out_of_blocks_preempts_and_every_sequence_finishes_as_if_alone(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    # 8 blocks of 64 tokens; six sequences of 10 + 110 tokens want 12: some must be preempted,
    # recomputed (prompt plus what they had produced) and go on where they stopped.
    engine, collector = _engine(tiny, slots=1)
    prompts = {f"r{i}": list(range(10 + i, 20 + i)) for i in range(6)}
    requests = {rid: EngineRequest(rid, [prompt], _greedy(110)) for rid, prompt in prompts.items()}
    for request in requests.values():
        engine.submit(request)
    _drain(engine, collector, set(requests), max_steps=5000)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.budget.num_used == 0
    for rid, prompt in prompts.items():
        assert collector.num_tokens(rid) == 110
        assert collector.text(rid) == _text_alone(tiny, prompt, _greedy(110)), rid
    # The newest are preempted first: the first admitted never was.
    assert requests["r0"].sequences[0].sched.num_preemptions == 0


def test_batch_lines_are_preempted_before_interactive_requests(tiny: tuple[torch.nn.Module, object]) -> None:
    engine, collector = _engine(tiny, slots=1)
    batch = [EngineRequest(f"b{i}", [list(range(10 + i, 20 + i))], _greedy(110), priority=1) for i in range(3)]
    interactive = [EngineRequest(f"i{i}", [list(range(40 + i, 50 + i))], _greedy(110)) for i in range(3)]
    for request in batch:  # admitted first: the older ones, yet the ones preempted
        engine.submit(request)
    engine.run_step()
    for request in interactive:
        engine.submit(request)
    _drain(engine, collector, {r.request_id for r in batch + interactive}, max_steps=5000)
    assert engine.scheduler.num_preemptions > 0
    assert all(r.sequences[0].sched.num_preemptions == 0 for r in interactive)
    assert all(collector.num_tokens(r.request_id) == 110 for r in batch + interactive)


def test_event_sequence_numbers_are_contiguous_per_request(tiny: tuple[torch.nn.Module, object]) -> None:
    engine, collector = _engine(tiny)
    engine.submit(EngineRequest("multi", [[1, 2, 3]], _greedy(5), num_choices=3))
    _drain(engine, collector, {"multi"})
    events = collector.events["multi"]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))  # 0 is the job's start event
    finishes = [e for e in events if isinstance(e, DeltaEvent) and e.finish_reason]
    assert sorted(e.index for e in finishes) == [0, 1, 2]
    assert collector.num_tokens("multi") == 15


def _wait_done(collector: Collector, request_id: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while request_id not in collector.done and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_failing_step_fails_every_request_and_the_engine_recovers(
    tiny: tuple[torch.nn.Module, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, collector = _engine(tiny)
    engine.submit(EngineRequest("a", [[1, 2, 3]], _greedy(5)))
    engine.run_step()

    def broken(*_args: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "decode", broken)
    engine.start()
    try:
        _wait_done(collector, "a")
        last = collector.events["a"][-1]
        assert isinstance(last, ErrorEvent) and last.kind is ErrorKind.INTERNAL
        monkeypatch.undo()
        engine.submit(EngineRequest("b", [[1, 2, 3]], _greedy(3)))
        _wait_done(collector, "b")
        assert isinstance(collector.events["b"][-1], EndEvent)
    finally:
        engine.stop()


SYSTEM = "You are a helpful assistant. Use the tools below when they help. " * 8


def test_prefix_cache_gives_the_same_tokens_and_counts_hits(tiny: tuple[torch.nn.Module, object]) -> None:
    _, tokenizer = tiny
    prompts = [_prompt(tokenizer, SYSTEM + question) for question in ("What is 2+2?", "Name a colour.", "Hi")]
    plain, plain_out = _engine(tiny)
    cached, cached_out = _engine(tiny, prefix_blocks=64)
    for engine, collector in ((plain, plain_out), (cached, cached_out)):
        for i, prompt in enumerate(prompts):  # one after another, as an agent's turns arrive
            engine.submit(EngineRequest(f"r{i}", [prompt], _greedy(8)))
            _drain(engine, collector, {f"r{i}"})
    for i in range(len(prompts)):
        assert _deltas(cached_out, f"r{i}") == _deltas(plain_out, f"r{i}")
    shared_blocks = len(_prompt(tokenizer, SYSTEM)) // BLOCK_SIZE
    assert isinstance(cached.scheduler.prefixes, PrefixCache)
    assert cached.scheduler.prefixes.stats.num_hit_tokens >= 2 * shared_blocks * BLOCK_SIZE
    ends = [cached_out.events[f"r{i}"][-1] for i in range(3)]
    assert ends[0].usage.cached_tokens == 0  # type: ignore[attr-defined]
    assert ends[1].usage.cached_tokens >= shared_blocks * BLOCK_SIZE  # type: ignore[attr-defined]


def _deltas(collector: Collector, request_id: str) -> list[object]:
    return [event for event in collector.events[request_id] if isinstance(event, DeltaEvent)]


def test_a_finished_turn_is_cached_for_the_next_turn(tiny: tuple[torch.nn.Module, object]) -> None:
    engine, collector = _engine(tiny, prefix_blocks=64)
    _, tokenizer = tiny
    first = _prompt(tokenizer, SYSTEM)
    turn1 = EngineRequest("turn1", [first], _greedy(40))
    engine.submit(turn1)
    _drain(engine, collector, {"turn1"})
    history = first + turn1.sequences[0].output_token_ids
    engine.submit(EngineRequest("turn2", [[*history, *_prompt(tokenizer, " and then?")]], _greedy(4)))
    _drain(engine, collector, {"turn2"})
    cached = collector.events["turn2"][-1].usage.cached_tokens  # type: ignore[attr-defined]
    # Every full block of turn 1 whose KV was computed (all but its last sampled token) is reused.
    assert cached == (len(history) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_the_prefix_cache_evicts_least_recently_used_blocks(tiny: tuple[torch.nn.Module, object]) -> None:
    engine, collector = _engine(tiny, prefix_blocks=4)
    for i in range(6):
        prompt = [100 + i] * (3 * BLOCK_SIZE + 1)
        engine.submit(EngineRequest(f"r{i}", [prompt], _greedy(1)))
        _drain(engine, collector, {f"r{i}"})
    assert isinstance(engine.scheduler.prefixes, PrefixCache)
    assert len(engine.scheduler.prefixes._block_of) == 4


def test_a_stop_string_ends_the_text_with_or_without_itself(tiny: tuple[torch.nn.Module, object]) -> None:
    """``include_stop_str_in_output``: the same cut, after the stop string instead of before it."""
    engine, collector = _engine(tiny)
    _, tokenizer = tiny
    prompt = _prompt(tokenizer, "hello")
    engine.submit(EngineRequest("free", [prompt], _greedy(24)))
    _drain(engine, collector, {"free"})
    free = collector.text("free")
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert len(stop) == 3
    cut = free.index(stop)
    for include in (False, True):
        params = dataclasses.replace(_greedy(24), stop_strings=(stop,), include_stop_str_in_output=include)
        engine.submit(EngineRequest(f"stop-{include}", [prompt], params))
        _drain(engine, collector, {f"stop-{include}"})
        assert collector.text(f"stop-{include}") == free[: cut + len(stop) if include else cut]
        finish = [e.finish_reason for e in _deltas(collector, f"stop-{include}") if e.finish_reason]  # type: ignore[attr-defined]
        assert finish == ["stop"]


def test_placement_keys_stay_held_while_the_prefix_cache_holds_their_prompt(
    tiny: tuple[torch.nn.Module, object],
) -> None:
    engine, collector = _engine(tiny, prefix_blocks=4)
    first = EngineRequest("a", [[7] * (3 * BLOCK_SIZE + 1)], _greedy(1), prefix_keys=PrefixKeys(("a0", "a1"), 10))
    engine.submit(first)
    _drain(engine, collector, {"a"})
    assert engine.held.num_keys == 2 and engine.held.released() == []
    # Another conversation's prompt takes three of the pool's four blocks: "a" keeps one of three.
    other = EngineRequest("b", [[8] * (3 * BLOCK_SIZE + 1)], _greedy(1), prefix_keys=PrefixKeys(("b0",), 20))
    engine.submit(other)
    _drain(engine, collector, {"b"})
    assert sorted(engine.held.released()) == [("a0", 10), ("a1", 10)]
    assert engine.held.num_keys == 1
