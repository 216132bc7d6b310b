"""What the loader hands the worker: a tokenizer read straight from its tokenizer.json that
behaves exactly as AutoTokenizer's, and a KV cache that starts as zeros."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.support.models import default_model_dir, tiny_random_llama_dir
from tests.support.qwen import qwen3_tokenizer_dir
from worker.models.loader import gguf_parsed_once, load_tokenizer, locate_default_gguf
from worker.native.kv_cache import KVCacheLayout, SlotKVCache

TEXTS = [
    "Hello, world! What's the capital of France?",
    "  leading spaces\tand tabs\nnew lines  ",
    "<|im_start|>user\nhi<|im_end|><think>x</think><tool_call>{}</tool_call><|endoftext|>",
    "ünïcödé 漢字 🙂 and code: def f(x): return x ** 2",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(
    scope="module",
    params=["smollm2", "tiny-llama", "qwen3", "qwen3_coder"],
)
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    if request.param == "smollm2":
        return default_model_dir()
    if request.param == "tiny-llama":
        return tiny_random_llama_dir()
    return qwen3_tokenizer_dir(request.param)


def _template(tokenizer: PreTrainedTokenizerBase, **kwargs: object) -> str:
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs)  # type: ignore[return-value]


def test_the_direct_tokenizer_behaves_as_autotokenizer(tokenizer_dir: Path) -> None:
    ours, auto = load_tokenizer(str(tokenizer_dir)), AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(ours) == len(auto) and ours.vocab_size == auto.vocab_size
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.pad_token_id,
    )  # fmt: skip
    assert ours.added_tokens_decoder == auto.added_tokens_decoder
    assert ours.chat_template == auto.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert _template(ours) == _template(auto)
    assert _template(ours, tools=TOOLS) == _template(auto, tools=TOOLS)


def test_a_new_cpu_kv_cache_is_zeros_and_each_layer_is_its_own_memory() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        layout = KVCacheLayout(3, 2, 8, dtype, torch.device("cpu"))
        cache = SlotKVCache(layout, 4, 100)
        assert cache.positions == 128  # whole blocks of 64 keys (batch-invariant attention reads them)
        tensors = [*cache.keys, *cache.values]
        assert all(t.dtype == dtype and t.shape == (5, 2, 128, 8) and not t.any() for t in tensors)
        for i, tensor in enumerate(tensors):
            tensor.fill_(i + 1)
        assert [int(t[0, 0, 0, 0]) for t in tensors] == list(range(1, len(tensors) + 1))


def test_a_conversion_parses_its_gguf_once_and_other_files_as_usual(tmp_path: Path) -> None:
    import gguf

    original = gguf.GGUFReader
    source = locate_default_gguf()
    other = tmp_path / "other.gguf"
    other.write_bytes(source.read_bytes())
    with gguf_parsed_once(source):
        first = gguf.GGUFReader(str(source))
        assert gguf.GGUFReader(source) is first  # transformers' config, tokenizer and weights reads
        second = gguf.GGUFReader(str(other))
        assert second is not first and len(second.tensors) == len(first.tensors) > 0
    assert gguf.GGUFReader is original
