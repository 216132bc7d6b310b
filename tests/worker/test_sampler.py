"""Batched sampling: each parameter, seeded determinism and batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.engine_helpers import make_seq
from worker.engine.sampler import Sampler, _block_argmax, _search_cdf, seeded_uniform
from worker.engine.sampling_params import SamplingParams
from worker.engine.sampling_state import SlotSamplingState
from worker.engine.sequence import Sequence

EOS = 3


def _sampler(num_slots: int, vocab_size: int) -> Sampler:
    return Sampler(SlotSamplingState(num_slots, vocab_size, torch.device("cpu")), frozenset({EOS}))


def _place(sampler: Sampler, seqs: list[Sequence]) -> torch.Tensor:
    for slot, seq in enumerate(seqs):
        seq.sched.slot = slot
        sampler.state.assign(slot, seq.params, seq.prompt_token_ids, seq.output_token_ids)
    return torch.arange(len(seqs))


def _frequencies(params: SamplingParams, logits: list[float], draws: int = 4000) -> list[float]:
    sampler = _sampler(draws, len(logits))
    seqs = [make_seq(params) for _ in range(draws)]
    slots = _place(sampler, seqs)
    tokens = sampler.sample(torch.tensor([logits] * draws), slots, seqs)
    counts = torch.bincount(tokens, minlength=len(logits)).float()
    return (counts / draws).tolist()


LOGITS = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]


def test_greedy_takes_the_argmax() -> None:
    sampler = _sampler(2, 5)
    seqs = [make_seq(SamplingParams(temperature=0)), make_seq(SamplingParams(temperature=0))]
    tokens = sampler.sample(torch.tensor([[0.1, 2.0, 0.3, 0, 0], [5.0, 1.0, 0, 0, 0]]), _place(sampler, seqs), seqs)
    assert tokens.tolist() == [1, 0]


def test_temperature_one_follows_the_softmax() -> None:
    frequencies = _frequencies(SamplingParams(temperature=1.0), LOGITS)
    for observed, expected in zip(frequencies, (0.4, 0.3, 0.2, 0.1), strict=True):
        assert observed == pytest.approx(expected, abs=0.03)


def test_low_temperature_sharpens() -> None:
    assert _frequencies(SamplingParams(temperature=0.2), LOGITS)[0] > 0.75


def test_top_k_keeps_only_the_k_best() -> None:
    frequencies = _frequencies(SamplingParams(top_k=2), LOGITS)
    assert frequencies[2] == frequencies[3] == 0
    assert frequencies[0] == pytest.approx(0.4 / 0.7, abs=0.03)


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    frequencies = _frequencies(SamplingParams(top_p=0.5), LOGITS)
    assert frequencies[2] == frequencies[3] == 0
    assert frequencies[1] > 0.3


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    frequencies = _frequencies(SamplingParams(min_p=0.5), LOGITS)
    assert frequencies[3] == 0
    assert frequencies[2] > 0.1


def test_top_p_over_a_flat_vocabulary_uses_the_exact_fallback() -> None:
    # 1,000 equal tokens: the 256 candidates hold too little mass, so the full sort decides.
    sampler = _sampler(400, 1000)
    seqs = [make_seq(SamplingParams(top_p=0.9)) for _ in range(400)]
    tokens = sampler.sample(torch.zeros(400, 1000), _place(sampler, seqs), seqs)
    assert len(set(tokens.tolist())) > 256
    assert max(tokens.tolist()) >= 256


def test_presence_and_frequency_penalties_lower_seen_tokens() -> None:
    sampler = _sampler(1, 4)
    seq = make_seq(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.1))
    slots = _place(sampler, [seq])
    logits = torch.tensor([[1.0, 1.5, 0.0, 0.0]])
    assert sampler.sample(logits, slots, [seq]).tolist() == [1]
    assert sampler.sample(logits, slots, [seq]).tolist() == [0]  # 1.5 - 0.5 - 0.1 < 1.0


def test_repetition_penalty_covers_the_prompt() -> None:
    sampler = _sampler(1, 4)
    seq = make_seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[1])
    assert sampler.sample(torch.tensor([[1.0, 1.5, 0.0, 0.0]]), _place(sampler, [seq]), [seq]).tolist() == [0]


def test_logit_bias_moves_a_token_to_the_top() -> None:
    sampler = _sampler(2, 4)
    biased = make_seq(SamplingParams(temperature=0, logit_bias=((2, 100.0),)))
    plain = make_seq(SamplingParams(temperature=0))
    tokens = sampler.sample(torch.tensor([[1.0, 1.5, 0.0, 0.0]] * 2), _place(sampler, [biased, plain]), [biased, plain])
    assert tokens.tolist() == [2, 1]


def test_min_tokens_suppresses_eos() -> None:
    sampler = _sampler(1, 5)
    seq = make_seq(SamplingParams(temperature=0, min_new_tokens=2))
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 1.0]])
    assert sampler.sample(logits, _place(sampler, [seq]), [seq]).tolist() == [4]
    seq.output_token_ids = [4, 4]
    assert sampler.sample(logits, _place(sampler, [seq]), [seq]).tolist() == [EOS]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)

    def run(batch_size: int, steps: int = 5) -> list[int]:
        sampler = _sampler(batch_size, 50)
        seqs = [make_seq(SamplingParams(seed=42, temperature=0.9, top_p=0.95))]
        seqs += [make_seq(SamplingParams(temperature=1.0)) for _ in range(batch_size - 1)]
        slots = _place(sampler, seqs)
        return [int(sampler.sample(logits[:batch_size], slots, seqs)[0]) for _ in range(steps)]

    alone = run(1)
    assert run(1) == alone
    assert run(6) == alone


def test_top_k_and_top_p_keep_ties_whichever_way_the_candidates_were_sorted() -> None:
    """Three equally likely best tokens and top_k=2: all three stay (as vLLM keeps ties), alone and
    beside a row whose top-p makes the step sort the whole vocabulary instead of taking the top-k."""
    vocab = 300
    logits = torch.zeros(2, vocab)
    logits[:, [7, 70, 170]] = 4.0
    tied = make_seq(SamplingParams(temperature=1.0, top_k=2, seed=1))
    flat = make_seq(SamplingParams(temperature=1.0, top_p=0.99, seed=2))
    kept = []
    for seqs in ([tied], [tied, flat]):
        sampler = _sampler(2, vocab)
        probs = torch.softmax(logits[: len(seqs)], dim=-1)
        kept.append(sampler._truncate(probs, _place(sampler, seqs), seqs)[0])
    assert torch.equal(kept[0], kept[1])
    assert (kept[0] > 0).nonzero().flatten().tolist() == [7, 70, 170]


def test_a_seeded_draw_depends_on_the_seed_and_position_alone() -> None:
    draws = [seeded_uniform(42, position) for position in range(20_000)]
    assert draws == [seeded_uniform(42, position) for position in range(20_000)]
    assert all(0.0 <= draw < 1.0 for draw in draws)
    assert len(set(draws)) > 19_900  # 24-bit draws: a few collisions at most
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert [seeded_uniform(43, position) for position in range(10)] != draws[:10]


def test_mixed_greedy_and_sampled_rows_in_one_batch() -> None:
    sampler = _sampler(2, 4)
    seqs = [make_seq(SamplingParams(temperature=0)), make_seq(SamplingParams(temperature=1.0, seed=3))]
    tokens = sampler.sample(torch.tensor([[0.0, 0.0, 5.0, 0.0]] * 2), _place(sampler, seqs), seqs)
    assert tokens[0] == 2


# Widths around the 256-token search blocks: one short block, exact multiples, a short last block.
_WIDTHS = st.sampled_from([1, 2, 255, 256, 257, 511, 512, 700, 1027])


@settings(max_examples=60, deadline=None)
@given(width=_WIDTHS, rows=st.integers(1, 5), levels=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_block_argmax_is_torch_argmax_first_maximum_included(width: int, rows: int, levels: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values make ties common; the first maximum must win, as with torch.argmax.
    logits = torch.randint(0, levels, (rows, width), generator=generator).float()
    logits[logits == 0] = float("-inf")  # grammar-masked tokens
    logits[:, -1] = torch.where(logits[:, -1] == float("-inf"), torch.zeros(rows), logits[:, -1])
    assert _block_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def _reference_search(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, ((1.0 - uniform) * cdf[:, -1])[:, None]).squeeze(1)


@settings(max_examples=80, deadline=None)
@given(width=_WIDTHS, rows=st.integers(1, 5), seed=st.integers(0, 2**31), sparse=st.booleans())
def test_block_search_picks_the_full_cdf_token(width: int, rows: int, seed: int, sparse: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Small integer weights sum exactly in float32, so both searches see the same CDF; zeros
    # (truncated tokens, whole empty blocks when sparse) must never be drawn.
    probs = torch.randint(0, 4, (rows, width), generator=generator).float()
    if sparse:
        probs *= torch.rand(rows, width, generator=generator) < 0.01
    probs[:, width // 2] += 1.0  # at least one token has mass
    uniform = torch.rand(rows, generator=generator)
    uniform[0] = 0.0  # the top of the CDF: the last token with mass
    tokens = _search_cdf(probs, uniform)
    assert tokens.tolist() == _reference_search(probs, uniform).tolist()
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())


def test_block_search_never_draws_a_zero_token_under_rounding() -> None:
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(64, 3000) * 4, dim=-1)
    probs[probs < 1e-4] = 0.0
    for _ in range(20):
        tokens = _search_cdf(probs, torch.rand(64))
        assert bool((probs.gather(1, tokens[:, None]) > 0).all())
