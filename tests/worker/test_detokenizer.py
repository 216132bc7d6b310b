"""Incremental detokenization with a real byte-level BPE tokenizer (SmolLM2's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from worker.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_path)


def _stream(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token_id) for token_id in token_ids]
    pieces.append(detokenizer.flush())
    return pieces


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 mix", "  spaces\n\ttabs", "Ωμέγα"])
def test_multibyte_characters_split_across_tokens_arrive_whole(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(tokenizer, token_ids)
    assert "".join(pieces) == tokenizer.decode(token_ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_an_emoji_spread_over_byte_tokens_is_held_until_complete(tokenizer: PreTrainedTokenizerBase) -> None:
    token_ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(token_ids) > 1, "the emoji should need several byte tokens"
    pieces = _stream(tokenizer, token_ids)
    assert pieces[:-2] == [""] * (len(token_ids) - 1)
    assert "".join(pieces) == "🎉"


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerBase) -> None:
    token_ids = [*tokenizer.encode("hi", add_special_tokens=False), tokenizer.eos_token_id]
    assert "".join(_stream(tokenizer, token_ids)) == "hi"


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=30))
def test_any_round_trippable_text_streams_back_exactly(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    # Characters the vocabulary has no bytes for (e.g. unassigned planes) decode lossily anyway.
    assume(tokenizer.decode(token_ids) == text and "\ufffd" not in text)
    pieces = _stream(tokenizer, token_ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
