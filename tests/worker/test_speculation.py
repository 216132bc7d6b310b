"""Speculation never changes the text: with drafted tokens verified in the step, every request
gets the tokens, text, logprobs and usage it gets one token a step.

The drafts here come from a drafter that knows the answer and spoils it at random places (and
from prompt lookup), so verification takes whole drafts, parts of them and none, for greedy
and seeded sampling, penalties, grammars, stop strings, several choices and a mixed batch. A
tiny random-weight model on the exact numerics (``--deterministic on``): what is checked is the
engine, not the model's text."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shared.events import DeltaEvent, EndEvent
from tests.support.models import tiny_random_llama_dir
from tests.worker.test_engine import Collector
from worker.engine.builder import EngineConfig, build_engine
from worker.engine.drafter import DraftState, PromptLookup
from worker.engine.engine import LLMEngine
from worker.engine.prefix_cache import BLOCK_SIZE
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduling_state import SequenceStatus
from worker.engine.sequence import EngineRequest
from worker.models.loader import LoadedModel, load_model
from worker.native.kv_cache import KVCacheLayout
from worker.structured import ConstraintCompiler, JsonSchemaConstraint

MAX_LEN = 384


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tiny_random_llama_dir(seed=5, hidden_size=128, num_layers=2)
    cache = tmp_path_factory.mktemp("cache")
    return load_model(str(folder), cache, "cpu", "bfloat16", MAX_LEN, "native", "auto", deterministic=True)


def _engine(
    loaded: LoadedModel, speculative: bool, step_tokens: int = 128, kv_lengths: int = 9, prefix_cache: bool = False
) -> tuple[LLMEngine, Collector]:
    """``kv_lengths``: the KV budget in sequences of MAX_LEN (few: sequences get preempted)."""
    layout = KVCacheLayout.from_config(loaded.model.config, torch.bfloat16, torch.device("cpu"))
    config = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=step_tokens,
        max_model_len=MAX_LEN,
        kv_cache_bytes=kv_lengths * layout.bytes_per_token * MAX_LEN,
        prefix_cache_bytes=(64 * BLOCK_SIZE * layout.bytes_per_token) if prefix_cache else 0,
        speculative="ngram" if speculative else "off",
    )
    collector = Collector()
    engine = build_engine(loaded.model, loaded.tokenizer, config, loaded.eos_token_ids, collector)
    assert (engine.drafter is not None) == speculative
    engine.scheduler.max_drafting = 16  # every decoding row may draft, however many there are
    return engine, collector


class SpoiledOracle:
    """Drafts the answer a run without speculation gave, spoiled at random positions."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], rng: random.Random, spoil: float) -> None:
        self.answers = answers
        self.rng = rng
        self.spoil = spoil

    def propose(self, tokens: Seq[int], state: DraftState, limit: int) -> list[int]:
        for prompt, answer in self.answers.items():
            if (
                tuple(tokens[: len(prompt)]) == prompt
                and list(tokens[len(prompt) :]) == answer[: len(tokens) - len(prompt)]
            ):
                done = len(tokens) - len(prompt)
                draft = answer[done : done + self.rng.randint(1, limit)]
                return [self.rng.randrange(100, 20_000) if self.rng.random() < self.spoil else t for t in draft]
        return [self.rng.randrange(100, 20_000) for _ in range(self.rng.randint(1, limit))]


@dataclass
class Outcome:
    tokens: list[list[int]]
    events: list[object]


def _run(engine: LLMEngine, collector: Collector, requests: list[EngineRequest]) -> list[Outcome]:
    for request in requests:
        engine.submit(request)
    steps = 0
    while not {request.request_id for request in requests} <= collector.done:
        engine.run_step()
        steps += 1
        assert steps < 3000, "requests did not finish"
        # Rejected drafts rolled back: a decoding sequence's cache holds all its tokens but the last.
        for request in requests:
            for seq in request.sequences:
                if seq.sched.status is SequenceStatus.DECODING:
                    assert seq.sched.num_computed_tokens == seq.num_tokens - 1
    return [
        Outcome([seq.output_token_ids for seq in request.sequences], collector.events[request.request_id])
        for request in requests
    ]


def _request(request_id: str, prompt: list[int], **params: object) -> EngineRequest:
    num_choices = int(params.pop("n", 1))  # type: ignore[call-overload]
    return EngineRequest(request_id, [prompt], SamplingParams(**params), num_choices=num_choices)  # type: ignore[arg-type]


def _uncached(event: object) -> object:
    if isinstance(event, EndEvent):
        return event.model_copy(update={"usage": event.usage.model_copy(update={"cached_tokens": 0})})
    return event


def _per_choice(events: list[object]) -> dict[int, list[object]]:
    choices: dict[int, list[object]] = {}
    for event in events:
        if isinstance(event, DeltaEvent):
            choices.setdefault(event.index, []).append(event.model_copy(update={"seq": 0}))
    return choices


PARAMS = st.sampled_from(
    [
        {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True},
        {"temperature": 0.0, "max_new_tokens": 20, "logprobs": 3},
        {"temperature": 1.0, "seed": 11, "max_new_tokens": 24, "ignore_eos": True},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 3, "max_new_tokens": 16, "logprobs": 2},
        {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "max_new_tokens": 20},
        {"temperature": 1.0, "seed": 5, "n": 2, "max_new_tokens": 12, "ignore_eos": True},
        {"temperature": 0.0, "min_new_tokens": 6, "max_new_tokens": 10},
    ]
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], phases=[Phase.generate]
)
@given(
    prompts=st.lists(st.lists(st.integers(100, 20_000), min_size=1, max_size=60), min_size=1, max_size=5),
    params=st.lists(PARAMS, min_size=5, max_size=5),
    spoil=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
    step_tokens=st.sampled_from([16, 64, 128]),
    kv_lengths=st.sampled_from([2, 9]),
    prefix_cache=st.booleans(),
)
def test_drafts_taken_in_part_or_whole_change_nothing(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: list[dict[str, object]],
    spoil: float,
    seed: int,
    step_tokens: int,
    kv_lengths: int,
    prefix_cache: bool,
) -> None:
    """Prompt chunks at any boundary, sequences preempted for KV blocks, prefix-cache hits (the
    same prompts run twice on one engine): the drafts change nothing."""

    def requests(tag: str) -> list[EngineRequest]:
        return [_request(f"{tag}{i}", prompt, **dict(params[i])) for i, prompt in enumerate(prompts)]

    engine, collector = _engine(loaded, speculative=False)
    expected = _run(engine, collector, requests("off"))

    engine, collector = _engine(loaded, True, step_tokens, kv_lengths, prefix_cache)
    answers = {tuple(prompt): outcome.tokens[0] for prompt, outcome in zip(prompts, expected, strict=True)}
    engine.drafter = SpoiledOracle(answers, random.Random(seed), spoil)
    got = _run(engine, collector, requests("on"))
    if prefix_cache:  # the same again, from the prefix cache: only the cached-token count differs
        got = _run(engine, collector, requests("again"))
        for outcome in got:
            outcome.events = [_uncached(event) for event in outcome.events]

    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have.tokens == want.tokens, f"request {i}: {params[i]}"
        if len(want.tokens) == 1:
            assert have.events == want.events, f"request {i}: {params[i]}"
        else:  # each choice's events are the same; how the choices' events interleave is not
            assert _per_choice(have.events) == _per_choice(want.events), f"request {i}: {params[i]}"
    if len(prompts) == 1:  # a lone sequence always drafts; the answer itself, unspoiled, is taken
        assert engine.num_draft_tokens > 0
        assert engine.num_accepted_tokens > 0 or spoil > 0


def test_prompt_lookup_drafts_a_repeated_span_and_the_text_is_the_same(loaded: LoadedModel) -> None:
    """An answer that copies its prompt: prompt lookup drafts it, verification keeps the drafts."""
    engine, collector = _engine(loaded, speculative=False)
    prompt = [random.Random(1).randrange(100, 20_000) for _ in range(40)]
    first = _run(engine, collector, [_request("probe", prompt, temperature=0.0, max_new_tokens=30, ignore_eos=True)])
    # The prompt then holds the answer the model gives to it: the model repeats it on its own.
    looped = prompt + first[0].tokens[0] + prompt
    expected = _run(engine, collector, [_request("off", looped, temperature=0.0, max_new_tokens=30, ignore_eos=True)])

    engine, collector = _engine(loaded, speculative=True)
    assert isinstance(engine.drafter, PromptLookup)
    got = _run(engine, collector, [_request("on", looped, temperature=0.0, max_new_tokens=30, ignore_eos=True)])
    assert got[0].tokens == expected[0].tokens
    assert [e for e in got[0].events if isinstance(e, DeltaEvent | EndEvent)] == [
        e for e in expected[0].events if isinstance(e, DeltaEvent | EndEvent)
    ]
    assert engine.num_accepted_tokens > 0


def test_grammars_stop_strings_and_logprobs_are_the_same_with_drafts(loaded: LoadedModel) -> None:
    """A JSON schema's mask at every verified position (greedy and seeded), a stop string found
    inside a drafted span, and logprobs: tokens and events equal a run without drafts."""
    compiler = ConstraintCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    compiled = compiler.compile_constraint(JsonSchemaConstraint(schema))
    prompt = [random.Random(7).randrange(100, 20_000) for _ in range(30)]

    def requests(tag: str, stop: tuple[str, ...]) -> list[EngineRequest]:
        return [
            EngineRequest(
                f"{tag}-json", [prompt], SamplingParams(temperature=0.0, max_new_tokens=40), constraint=compiled
            ),
            EngineRequest(
                f"{tag}-json-seeded", [prompt], SamplingParams(temperature=1.0, seed=9, max_new_tokens=40),
                constraint=compiled,
            ),
            _request(f"{tag}-stop", prompt[:20], temperature=0.0, max_new_tokens=40, ignore_eos=True, stop_strings=stop,
                     logprobs=2),
        ]  # fmt: skip

    engine, collector = _engine(loaded, speculative=False)
    free = _run(engine, collector, requests("probe", ()))
    text = collector.text("probe-stop")
    stop = (text[len(text) // 2 : len(text) // 2 + 3],)  # a stop string the answer reaches half-way
    engine, collector = _engine(loaded, speculative=False)
    expected = _run(engine, collector, requests("off", stop))
    assert len(expected[2].tokens[0]) < len(free[2].tokens[0])  # the stop string cut it

    engine, collector = _engine(loaded, speculative=True)
    answers = {tuple(prompt): expected[0].tokens[0], tuple(prompt[:20]): free[2].tokens[0]}
    engine.drafter = SpoiledOracle(answers, random.Random(3), 0.2)
    got = _run(engine, collector, requests("on", stop))
    for want, have in zip(expected, got, strict=True):
        assert have.tokens == want.tokens
        assert have.events == want.events
    assert engine.num_accepted_tokens > 0


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 6), min_size=1, max_size=80), limit=st.integers(1, 8))
def test_prompt_lookup_drafts_what_followed_an_earlier_occurrence_of_the_suffix(tokens: list[int], limit: int) -> None:
    state = DraftState()
    draft = PromptLookup().propose(tokens, state, limit)
    assert len(draft) <= min(limit, state.draft_len)
    if draft:
        starts = [
            end
            for n in range(2, 5)
            for end in range(n, len(tokens))
            if len(tokens) > n and tokens[end - n : end] == tokens[-n:] and tokens[end : end + len(draft)] == draft
        ]
        assert starts, (tokens, draft)
    elif len(tokens) > 2:  # no earlier occurrence of the last two tokens
        assert all(tokens[end - 2 : end] != tokens[-2:] for end in range(2, len(tokens)))


def test_a_sequence_whose_drafts_keep_failing_pauses_longer_each_time() -> None:
    state, lookup, tokens = DraftState(), PromptLookup(), [1, 2, 3, 1, 2]
    pauses = []
    for _ in range(3):
        for _ in range(3):  # three drafts in a row that yield nothing
            assert lookup.propose(tokens, state, 8)
            state.record(len(lookup.propose(tokens, state, 8)) or 1, 0)
        skipped = 0
        while not lookup.propose(tokens, state, 8):
            skipped += 1
        pauses.append(skipped)
    assert pauses[0] > 0 and pauses[1] > pauses[0] and pauses[2] > pauses[1]
    state.record(2, 2)  # a draft taken whole: the next may be longer
    assert state.draft_len == 4
