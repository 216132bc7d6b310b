"""The KV cache held by tokens: a slot takes memory only for what is written into it and gives
it back on release; the block budget counts what sequences hold."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from tests.support.models import default_model_dir
from tests.worker.engine_helpers import make_seq
from worker.engine.builder import (
    EngineConfig,
    _kv_cache_and_budget,
    default_max_num_batched_tokens,
    num_slots_for_budget,
)
from worker.engine.kv_blocks import KVBlockBudget
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.native.kv_cache import KVCacheLayout, SlotKVCache, block_tokens, is_lazily_backed
from worker.settings import WorkerSettings

CPU = torch.device("cpu")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not is_lazily_backed(CPU), reason="needs madvise (Linux)")
def test_a_slot_takes_memory_as_it_is_written_and_trimming_gives_it_back() -> None:
    layout = KVCacheLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.float32, device=CPU)
    slot_mib = 2 * 2 * 4 * 8192 * 64 * 4 / 2**20  # keys and values of 2 layers: 32 MiB a slot
    before = _resident_bytes()
    cache = SlotKVCache(layout, num_slots=64, max_model_len=8192)  # 2 GiB of address space
    assert cache.num_bytes > 2 * 2**30 and _resident_bytes() - before < 16 * 2**20
    assert cache.block_tokens == 16  # 16 positions of a 64-wide fp32 head fill a page
    for tensors in (cache.keys, cache.values):
        for tensor in tensors:
            tensor[1].fill_(1.5)
            tensor[2, :, :100].fill_(2.5)
    cache.hold(1, 512)  # all 8192 positions
    cache.hold(2, 7)  # 100 positions
    grown = _resident_bytes() - before
    assert slot_mib * 0.9 < grown / 2**20 < slot_mib * 1.2
    cache.vacate(1)
    cache.trim(max_blocks=600)  # within the limit: a vacant slot keeps its pages for the next sequence
    assert _resident_bytes() - before > slot_mib * 0.9 * 2**20
    cache.trim(max_blocks=100)
    assert _resident_bytes() - before < 16 * 2**20 and cache.num_backed_blocks == 7
    assert not cache.keys[0][1].any() and not cache.values[1][1].any()  # reads as zeros again
    assert bool((cache.keys[1][2, :, :100] == 2.5).all())  # the held slot keeps its tokens


@pytest.mark.skipif(not is_lazily_backed(CPU), reason="needs madvise (Linux)")
def test_trimming_takes_empty_slots_first_then_tails_past_what_a_slot_holds() -> None:
    layout = KVCacheLayout(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=CPU)
    cache = SlotKVCache(layout, num_slots=3, max_model_len=256)
    for slot in range(3):
        cache.keys[0][slot].fill_(slot + 1.0)
        cache.hold(slot, 16)  # 256 positions
    cache.hold(0, 4)  # its sequence now holds 64 positions (a shorter one took the slot)
    cache.vacate(2)
    cache.trim(max_blocks=36)  # 48 backed: the empty slot 2 goes first, whole
    assert not cache.keys[0][2].any() and bool((cache.keys[0][0] == 1.0).all())
    assert cache.num_backed_blocks == 32
    cache.trim(max_blocks=20)  # then slot 0's tail past its 64 positions
    assert bool((cache.keys[0][0, :, :64] == 1.0).all()) and not cache.keys[0][0, :, 64:].any()
    assert bool((cache.keys[0][1] == 2.0).all()) and cache.num_backed_blocks == 20


def test_a_block_is_one_page_of_a_heads_positions() -> None:
    bf16 = KVCacheLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, device=CPU)
    fp32 = KVCacheLayout(num_layers=2, num_kv_heads=2, head_dim=128, dtype=torch.float32, device=CPU)
    assert block_tokens(bf16) == 32 and block_tokens(fp32) == 8


def test_the_budget_admits_with_a_watermark_grows_and_frees() -> None:
    budget = KVBlockBudget(num_blocks=10, block_tokens=32)
    assert budget.watermark == 1
    holder = make_seq().sched
    assert budget.can_admit(9 * 32) and not budget.can_admit(9 * 32 + 1)
    budget.grow(holder, 33)
    assert holder.num_kv_blocks == 2 and budget.num_free == 8
    assert budget.extra_blocks(holder, 64) == 0 and budget.extra_blocks(holder, 65) == 1
    budget.grow(holder, 65)
    assert budget.usage == pytest.approx(0.3)
    with pytest.raises(RuntimeError, match="overdrawn"):
        budget.grow(make_seq().sched, 8 * 32)
    budget.free(holder)
    assert budget.num_used == 0 and holder.num_kv_blocks == 0
    assert budget.fits_alone(9 * 32) and not budget.fits_alone(10 * 32)


def _admit_all(scheduler: Scheduler, rounds: int = 200) -> int:
    """Schedule with no model: prompt chunks count as computed; returns the most that ran at once."""
    peak = 0
    for _ in range(rounds):
        step = scheduler.schedule()
        step.skip_decode = True  # prompt chunks only: nothing decodes in these rounds
        scheduler.complete_step(step)
        peak = max(peak, scheduler.num_running)
        if not scheduler.waiting:
            break
    return peak


@pytest.mark.skipif(not is_lazily_backed(CPU), reason="needs madvise (Linux)")
def test_the_default_budget_and_context_run_64_short_streams_or_a_7000_token_prompt_beside_32() -> None:
    """The default model's own layout, the default budget and its full context: under slots this
    was 21 sequences at once whatever --max-num-seqs said."""
    config = AutoConfig.from_pretrained(default_model_dir())
    layout = KVCacheLayout.from_config(config, torch.bfloat16, CPU)
    defaults = WorkerSettings.model_fields
    engine_config = EngineConfig(
        max_num_seqs=64,
        max_num_batched_tokens=default_max_num_batched_tokens(CPU),
        max_model_len=config.max_position_embeddings,
        kv_cache_bytes=int(defaults["kv_cache_memory_gib"].default * 2**30),
    )
    assert num_slots_for_budget(layout, engine_config.max_model_len, engine_config.kv_cache_bytes) == 21
    for prompts, expected in [([60] * 64, 64), ([7000] + [60] * 32, 33)]:
        cache, budget = _kv_cache_and_budget(layout, engine_config, "tokens")
        scheduler = Scheduler(cache.num_slots, 64, engine_config.max_num_batched_tokens, budget=budget)
        for i, length in enumerate(prompts):
            scheduler.add(make_seq(SamplingParams(max_new_tokens=200), list(range(length)), f"r{i}"))
        assert _admit_all(scheduler) == expected
        assert budget.num_used == sum(budget.blocks_for(length + 1) for length in prompts)
