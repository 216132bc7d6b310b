"""Assemble an engine for a loaded model: KV layout, slots and block budget from the memory budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from worker.engine.detokenizer import Decoder
from worker.engine.drafter import PromptLookup
from worker.engine.engine import LLMEngine, OutputSink
from worker.engine.host_allocator import keep_freed_memory
from worker.engine.kv_blocks import KVBlockBudget
from worker.engine.model_runner import ModelRunner
from worker.engine.plan import ExecutionPlan, KVLayout, Speculation, resolve_plan
from worker.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from worker.engine.prefixes import NoPrefixes, Prefixes
from worker.engine.sampling_state import SlotSamplingState
from worker.engine.scheduler import Scheduler
from worker.engine.shared_prefix import SharedPrefixes
from worker.native.kv_cache import KVCacheLayout, SlotKVCache, block_tokens
from worker.native.model_config import text_config

logger = logging.getLogger(__name__)


# Measured on a 2-core CPU with SmolLM2 and 32 streams: 512 kept ITL p99 at 2.9x p50, 256 at 2.1x
# (prompt chunks make the steps they share longer); on a GPU a step's cost barely grows with it.
_CPU_STEP_TOKENS = 256
_GPU_STEP_TOKENS = 2048
_PREFIX_SLOTS_PER_SEQ = 4


def default_max_num_batched_tokens(device: torch.device) -> int:
    return _GPU_STEP_TOKENS if device.type == "cuda" else _CPU_STEP_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_bytes: int
    prefix_cache_bytes: int = 0
    # For a benchmark's comparison only (see plan.py): "slots" splits the budget into full-length
    # slots even where memory could follow the tokens (`make bench` compares the two); False
    # copies cached prefixes into each slot even where they could be held once (`make bench-kv`).
    kv_layout: Literal["auto", "slots"] = "auto"
    share_prefixes: bool = True
    speculative: Speculation = "off"  # --speculative (the plan keeps it where it cannot change the text)

    def plan_for(self, model: torch.nn.Module, device: torch.device, compiled_step: bool = False) -> ExecutionPlan:
        return resolve_plan(
            model, device, self.prefix_cache_bytes, self.kv_layout, self.share_prefixes, compiled_step,
            self.speculative,
        )  # fmt: skip


def build_engine(
    model: torch.nn.Module,
    tokenizer: Decoder,
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    sink: OutputSink,
    plan: ExecutionPlan | None = None,
) -> LLMEngine:
    """``plan``: resolved by the worker (with its compiled step); by default from ``config``."""
    param = next(model.parameters())
    if param.device.type == "cpu":
        keep_freed_memory()
    plan = plan or config.plan_for(model, param.device)
    layout = KVCacheLayout.from_config(text_config(model.config), param.dtype, param.device)
    sharing = plan.prefix_policy == "shared"
    # Prefix slots are virtual memory until written: room for every running sequence's chain and
    # as many again that none reads (an agent's earlier turns, branches), within the idle budget.
    num_prefix_slots = _PREFIX_SLOTS_PER_SEQ * config.max_num_seqs if sharing else 0
    cache, budget = _kv_cache_and_budget(layout, config, plan.kv_layout, num_prefix_slots=num_prefix_slots)
    num_slots = cache.num_slots
    held = "held by tokens" if cache.held_by_tokens else "in full-length slots"
    logger.info(
        "KV cache: %.2f GiB %s on %s, %s: %d blocks of %d tokens (%d tokens), max concurrency %d",
        budget.num_blocks * budget.block_tokens * layout.bytes_per_token / 2**30,
        layout.dtype,
        layout.device,
        held,
        budget.num_blocks,
        budget.block_tokens,
        budget.num_blocks * budget.block_tokens,
        num_slots,
    )
    runner = ModelRunner(model, cache)
    sampling_state = SlotSamplingState(num_slots, runner.vocab_size, layout.device)
    prefixes: Prefixes = NoPrefixes()
    if sharing:
        idle_blocks = config.prefix_cache_bytes // (budget.block_tokens * layout.bytes_per_token)
        prefixes = SharedPrefixes(cache, budget, idle_blocks)
        logger.info(
            "prefix cache: prompt prefixes held once, shared by the sequences that read them; "
            "up to %d blocks of %d tokens (%.2f GiB) kept while none reads them",
            idle_blocks, budget.block_tokens, config.prefix_cache_bytes / 2**30,
        )  # fmt: skip
    elif plan.prefix_policy == "copy":
        num_blocks = config.prefix_cache_bytes // (layout.bytes_per_token * BLOCK_SIZE)
        if num_blocks > 0:
            copied = prefixes = PrefixCache(cache, num_blocks)
            size_gib = copied.num_bytes / 2**30
            logger.info("prefix cache: %d blocks of %d tokens, %.2f GiB", num_blocks, BLOCK_SIZE, size_gib)
    scheduler = Scheduler(
        num_slots, config.max_num_seqs, config.max_num_batched_tokens, budget=budget, memory=cache,
        prefixes=prefixes,
    )  # fmt: skip
    return LLMEngine(
        runner, scheduler, sampling_state, tokenizer, eos_token_ids, config.max_model_len, sink,
        exact_sums=plan.is_exact, drafter=PromptLookup() if plan.speculation == "ngram" else None,
    )  # fmt: skip


def _kv_cache_and_budget(
    layout: KVCacheLayout, config: EngineConfig, kv_layout: KVLayout, num_prefix_slots: int = 0
) -> tuple[SlotKVCache, KVBlockBudget]:
    """Where slots take memory only for the tokens they hold (the CPU), there is a slot per
    ``--max-num-seqs`` and the budget is counted in blocks; elsewhere (CUDA) the budget is split
    into full-length slots as before, and the block count never binds."""
    tokens_per_block = block_tokens(layout)
    block_bytes = tokens_per_block * layout.bytes_per_token
    if kv_layout == "tokens":
        budget = KVBlockBudget(max(1, config.kv_cache_bytes // block_bytes), tokens_per_block)
        if not budget.fits_alone(config.max_model_len):
            raise ValueError(_too_small(layout, config))
        return SlotKVCache(layout, config.max_num_seqs, config.max_model_len, num_prefix_slots=num_prefix_slots), budget
    num_slots = min(config.max_num_seqs, num_slots_for_budget(layout, config.max_model_len, config.kv_cache_bytes))
    if num_slots < 1:
        raise ValueError(_too_small(layout, config))
    slot_blocks = -(-config.max_model_len // tokens_per_block)
    budget = KVBlockBudget(num_slots * slot_blocks, tokens_per_block)
    # Past the slots' blocks, the admission watermark: a free slot's sequence then always fits.
    budget.num_blocks += budget.watermark
    return SlotKVCache(layout, num_slots, config.max_model_len, held_by_tokens=False), budget


def num_slots_for_budget(layout: KVCacheLayout, max_model_len: int, budget_bytes: int) -> int:
    """How many full-length slots (plus the scratch slot) fit in the KV memory budget."""
    slot_bytes = layout.bytes_per_token * max_model_len
    return max(0, budget_bytes // slot_bytes - 1)


def _too_small(layout: KVCacheLayout, config: EngineConfig) -> str:
    need_gib = 1.02 * layout.bytes_per_token * config.max_model_len / 2**30
    return (
        f"KV cache budget {config.kv_cache_bytes / 2**30:.2f} GiB cannot hold one sequence of "
        f"{config.max_model_len} tokens (needs ~{need_gib:.2f} GiB): raise --kv-cache-memory-gib "
        "or lower --max-model-len"
    )
