"""A request's text depends on the request alone (``--deterministic on``, bf16, the native
forward): for random prompts, seeds and settings, the tokens generated alone equal those
generated in random batches of 2-16 that join at random steps, with prefill chunked at random
boundaries and the thread count changed at random steps, and after prefix-cache hits, for
greedy and seeded sampling (top-k and top-p among them: the sampler's sums are in the property
too). The same for a mixture of experts, whose rows share experts differently in every batch.

A tiny random-weight model is the honest tool here: what is checked is the engine's numerics
and scheduling, not the model's text. The default model is checked the same way, once, in
``tests/e2e/test_default_model.py``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.models import tiny_random_llama_dir
from tests.support.qwen import tiny_random_qwen3_moe_dir
from tests.worker.test_engine import Collector
from worker.engine.builder import EngineConfig, build_engine
from worker.engine.engine import LLMEngine
from worker.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import EngineRequest, ResumeState
from worker.models.loader import LoadedModel, load_model
from worker.native.kv_cache import KVCacheLayout

MAX_LEN = 512


@dataclass(frozen=True)
class Spec:
    """One request: its prompt and how it samples."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    seed: int | None  # None: greedy
    temperature: float
    top_k: int
    top_p: float = 1.0

    def request(self, request_id: str) -> EngineRequest:
        params = SamplingParams(
            temperature=self.temperature if self.seed is not None else 0.0,
            top_k=self.top_k if self.seed is not None else 0,
            top_p=self.top_p if self.seed is not None else 1.0,
            seed=self.seed,
            max_new_tokens=self.max_new_tokens,
            ignore_eos=True,
        )
        return EngineRequest(request_id, [list(self.prompt)], params)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    # llama: 128 wide, 4 heads over 2 kv heads (grouped-query attention), 3 layers, SmolLM2's
    # vocabulary. qwen3_moe: 16 experts, 4 a token, Qwen3's vocabulary; which experts a row's
    # tokens share with the other rows of a step changes from step to step.
    if request.param == "llama":
        folder = tiny_random_llama_dir(seed=3, hidden_size=128, num_layers=3)
    else:
        folder = tiny_random_qwen3_moe_dir()
    cache = tmp_path_factory.mktemp("cache")
    model = load_model(str(folder), cache, "cpu", "bfloat16", MAX_LEN, "native", "auto", deterministic=True)
    assert model.model.dtype == torch.bfloat16 and model.model.deterministic
    return model


def _engine(loaded: LoadedModel, step_tokens: int, prefix_cache: bool) -> tuple[LLMEngine, Collector]:
    layout = KVCacheLayout.from_config(loaded.model.config, torch.bfloat16, torch.device("cpu"))
    config = EngineConfig(
        max_num_seqs=16,
        max_num_batched_tokens=step_tokens,
        max_model_len=MAX_LEN,
        kv_cache_bytes=17 * layout.bytes_per_token * MAX_LEN,
        prefix_cache_bytes=(256 * BLOCK_SIZE * layout.bytes_per_token) if prefix_cache else 0,
    )
    collector = Collector()
    engine = build_engine(loaded.model, loaded.tokenizer, config, loaded.eos_token_ids, collector)
    return engine, collector


def _run(
    engine: LLMEngine,
    collector: Collector,
    arrivals: list[tuple[int, EngineRequest]],
    threads_at: dict[int, int] | None = None,
) -> None:
    """Submit each request at its step, then step until all are done; ``threads_at``: the torch
    thread count to switch to before a step (as a worker's host pool does while it serves)."""
    pending = sorted(arrivals, key=lambda arrival: arrival[0])
    ids = {request.request_id for _, request in arrivals}
    step = 0
    threads = torch.get_num_threads()
    try:
        while not ids <= collector.done:
            while pending and pending[0][0] <= step:
                engine.submit(pending.pop(0)[1])
            if threads_at and step in threads_at:
                torch.set_num_threads(threads_at[step])
            engine.run_step()
            step += 1
            assert step < 5000, "requests did not finish"
    finally:
        torch.set_num_threads(threads)


def _alone(loaded: LoadedModel, specs: list[Spec]) -> list[list[int]]:
    """Each request on its own: no prefix cache, the whole prompt in one step."""
    engine, collector = _engine(loaded, step_tokens=MAX_LEN, prefix_cache=False)
    tokens = []
    for i, spec in enumerate(specs):
        request = spec.request(f"alone{i}")
        _run(engine, collector, [(0, request)])
        tokens.append(request.sequences[0].output_token_ids)
    return tokens


prompts = st.lists(st.integers(100, 20_000), min_size=1, max_size=150).map(tuple)
specs = st.builds(
    Spec,
    prompt=prompts,
    max_new_tokens=st.integers(1, 24),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
    temperature=st.sampled_from([0.6, 1.0, 1.5]),
    top_k=st.sampled_from([0, 0, 40]),
    top_p=st.sampled_from([1.0, 1.0, 0.9]),
)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], phases=[Phase.generate]
)
@given(
    batch=st.lists(specs, min_size=2, max_size=16),
    data=st.data(),
)
def test_a_request_gets_the_same_tokens_alone_batched_chunked_and_after_a_cache_hit(
    loaded: LoadedModel, batch: list[Spec], data: st.DataObject
) -> None:
    # Some requests repeat another's prompt, or extend it by its earlier turn: prefix-cache hits.
    for i in range(1, len(batch)):
        source = batch[data.draw(st.integers(0, i - 1), label=f"source of {i}")]
        kind = data.draw(st.sampled_from(["own", "same", "extends"]), label=f"prompt of {i}")
        if kind != "own":
            extra = data.draw(prompts, label=f"extra of {i}") if kind == "extends" else ()
            batch[i] = replace(batch[i], prompt=(source.prompt + extra)[:300])
    expected = _alone(loaded, batch)

    step_tokens = data.draw(st.integers(16, 256), label="step token budget (prefill chunk boundaries)")
    engine, collector = _engine(loaded, step_tokens, prefix_cache=True)
    arrivals = [
        (data.draw(st.integers(0, 30), label=f"arrival of {i}"), spec.request(f"r{i}")) for i, spec in enumerate(batch)
    ]
    # The thread count changes while they run, as a worker's does when a neighbour turns busy.
    switches = data.draw(st.lists(st.integers(0, 60), max_size=3), label="steps where the thread count changes")
    threads_at = {step: 1 + (i + torch.get_num_threads()) % 2 for i, step in enumerate(sorted(switches))}
    _run(engine, collector, arrivals, threads_at)
    for i, (_, request) in enumerate(arrivals):
        assert request.sequences[0].output_token_ids == expected[i], f"request {i} ({batch[i]})"

    # The same requests again, one after another, on the engine whose prefix cache now holds them.
    assert isinstance(engine.scheduler.prefixes, PrefixCache)
    hits_before = engine.scheduler.prefixes.stats.num_hit_tokens
    for i, spec in enumerate(batch):
        request = spec.request(f"again{i}")
        _run(engine, collector, [(0, request)])
        assert request.sequences[0].output_token_ids == expected[i], f"request {i} after a cache hit"
    if any(len(spec.prompt) > BLOCK_SIZE for spec in batch):  # a full block to reuse
        assert engine.scheduler.prefixes.stats.num_hit_tokens > hits_before


def test_the_same_seed_gives_the_same_draws_from_any_position(loaded: LoadedModel) -> None:
    """What a worker resuming a job relies on: the draw for output position p comes from (seed, p)."""
    spec = Spec(tuple(range(200, 260)), max_new_tokens=30, seed=7, temperature=1.5, top_k=0)
    first = _alone(loaded, [spec])[0]
    engine, collector = _engine(loaded, step_tokens=64, prefix_cache=False)
    request = spec.request("resumed")
    request.resume = ResumeState(next_event_seq=1, output_token_ids={0: first[:11]}, finished_choices=frozenset())
    _run(engine, collector, [(0, request)])
    assert request.sequences[0].output_token_ids == first
