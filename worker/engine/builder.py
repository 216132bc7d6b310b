"""Assemble an engine for a loaded model: KV layout and slot count from the memory budget."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from worker.engine.detokenizer import Decoder
from worker.engine.engine import LLMEngine, OutputSink
from worker.engine.host_allocator import keep_freed_memory
from worker.engine.kv_cache import KVCacheLayout, SlotKVCache, num_slots_for_budget
from worker.engine.model_runner import ModelRunner
from worker.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from worker.engine.sampler import SlotSamplingState
from worker.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


# Measured on a 2-core CPU with SmolLM2 and 32 streams: 512 kept ITL p99 at 2.9x p50, 256 at 2.1x
# (prompt chunks make the steps they share longer); on a GPU a step's cost barely grows with it.
_CPU_STEP_TOKENS = 256
_GPU_STEP_TOKENS = 2048


def default_max_num_batched_tokens(device: torch.device) -> int:
    return _GPU_STEP_TOKENS if device.type == "cuda" else _CPU_STEP_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_bytes: int
    prefix_cache_bytes: int = 0


def build_engine(
    model: torch.nn.Module,
    tokenizer: Decoder,
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    sink: OutputSink,
) -> LLMEngine:
    param = next(model.parameters())
    if param.device.type == "cpu":
        keep_freed_memory()
    layout = KVCacheLayout.from_config(model.config, param.dtype, param.device)
    fitting = num_slots_for_budget(layout, config.max_model_len, config.kv_cache_bytes)
    num_slots = min(config.max_num_seqs, fitting)
    if num_slots < 1:
        need_gib = 2 * layout.bytes_per_token * config.max_model_len / 2**30
        raise ValueError(
            f"KV cache budget {config.kv_cache_bytes / 2**30:.2f} GiB cannot hold one sequence of "
            f"{config.max_model_len} tokens (needs ~{need_gib:.2f} GiB): raise --kv-cache-memory-gib "
            "or lower --max-model-len"
        )
    cache = SlotKVCache(layout, num_slots, config.max_model_len)
    logger.info(
        "KV cache: %d slots x %d tokens, %.2f GiB %s on %s (max concurrency %d)",
        num_slots,
        config.max_model_len,
        cache.num_bytes / 2**30,
        layout.dtype,
        layout.device,
        num_slots,
    )
    runner = ModelRunner(model, cache)
    sampling_state = SlotSamplingState(num_slots, runner.vocab_size, layout.device)
    scheduler_factory = functools.partial(Scheduler, num_slots, config.max_num_seqs, config.max_num_batched_tokens)
    prefix_cache = None
    num_blocks = config.prefix_cache_bytes // (layout.bytes_per_token * BLOCK_SIZE)
    if num_blocks > 0:
        prefix_cache = PrefixCache(layout, num_blocks)
        size_gib = prefix_cache.num_bytes / 2**30
        logger.info("prefix cache: %d blocks of %d tokens, %.2f GiB", num_blocks, BLOCK_SIZE, size_gib)
    return LLMEngine(
        runner, scheduler_factory, sampling_state, tokenizer, eos_token_ids, config.max_model_len, sink, prefix_cache
    )
