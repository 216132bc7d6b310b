"""Tiny models for tests: random weights (named as such), but the real SmolLM2 tokenizer and
chat template, so prompts, detokenization and stop strings behave as in production."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from worker.models.loader import ensure_default_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cache_dir() -> Path:
    return Path(os.environ.get("RELAYLM_TEST_CACHE", REPO_ROOT / ".cache" / "tests"))


def default_model_dir() -> Path:
    """The real default model, converted once from the packaged GGUF."""
    return ensure_default_model(test_cache_dir())


def tiny_random_llama_dir(seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """A Llama with random weights and SmolLM2's tokenizer: 2 layers, 64 wide (~13 MB) by default.

    Random weights are the honest tool where a test or benchmark times the machinery around a
    model rather than the model; wider ones make workers compute-bound."""
    shape = "" if (hidden_size, num_layers) == (64, 2) else f"-{hidden_size}x{num_layers}"
    target = test_cache_dir() / f"tiny-random-llama-{seed}{shape}"
    marker = target / ".built"
    if marker.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".tiny-{seed}{shape}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return target
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        marker.touch()
    return target
