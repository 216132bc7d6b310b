"""Two tokenizers for constrained decoding: the real SmolLM2 one, where ``<tool_call>`` is plain
text of several tokens, and a Qwen-style copy of it where ``<tool_call>``/``</tool_call>`` are
single added tokens, as in Qwen3's vocabulary. Both model vocabularies are padded past the
tokenizer, as checkpoints with padded embeddings are."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from worker.structured import ConstraintCompiler

VOCAB_PADDING = 64


@dataclass(frozen=True)
class TokenizerCase:
    name: str
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    compiler: ConstraintCompiler

    @property
    def stop_token_id(self) -> int:
        return self.tokenizer.eos_token_id


def make_case(name: str, tokenizer: PreTrainedTokenizerBase) -> TokenizerCase:
    vocab_size = len(tokenizer) + VOCAB_PADDING
    compiler = ConstraintCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    return TokenizerCase(name, tokenizer, vocab_size, compiler)


def qwen_style_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    return tokenizer


@pytest.fixture(scope="session")
def smollm2_case(default_model_path: Path) -> TokenizerCase:
    return make_case("smollm2", AutoTokenizer.from_pretrained(default_model_path))


@pytest.fixture(scope="session")
def qwen_style_case(default_model_path: Path) -> TokenizerCase:
    return make_case("qwen_style", qwen_style_tokenizer(default_model_path))


@pytest.fixture(params=["smollm2", "qwen_style"])
def tokenizer_case(request: pytest.FixtureRequest) -> TokenizerCase:
    return request.getfixturevalue(f"{request.param}_case")
