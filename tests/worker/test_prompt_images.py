"""A prompt's images as the engine holds them: placeholders named by image for the prefix caches,
and the rows of a prefill chunk that take image embeddings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from worker.engine.prompt_images import ImageFeatures, PromptImages, placeholder_key

SHA_A, SHA_B = "a" * 64, "b" * 64


def _images(positions: list[int], sha: str = SHA_A) -> PromptImages:
    keys = [placeholder_key(sha, index) for index in range(len(positions))]
    return PromptImages(positions, keys, lambda: ImageFeatures(torch.zeros(len(positions), 4), []))


@given(st.lists(st.integers(0, 200), min_size=1, max_size=40, unique=True), st.integers(201, 260))
def test_placeholders_are_named_by_their_image_and_nothing_else_changes(positions: list[int], length: int) -> None:
    positions.sort()
    tokens = list(range(1000, 1000 + length))
    keyed_a, keyed_b = _images(positions).keyed(tokens), _images(positions, SHA_B).keyed(tokens)
    for index, token in enumerate(tokens):
        if index in positions:
            assert keyed_a[index] < 0 and keyed_a[index] != keyed_b[index]  # never a token id; per image
        else:
            assert keyed_a[index] == keyed_b[index] == token
    assert len(set(keyed_a[p] for p in positions)) == len(positions)  # each placeholder its own name


@given(st.lists(st.integers(0, 100), min_size=1, max_size=30, unique=True), st.integers(0, 100), st.integers(1, 50))
def test_a_chunk_takes_exactly_the_embeddings_of_its_image_positions(
    positions: list[int], start: int, length: int
) -> None:
    positions.sort()
    found = _images(positions).rows_in(start, length)
    inside = [(p - start, i) for i, p in enumerate(positions) if start <= p < start + length]
    if not inside:
        assert found is None
        return
    assert found is not None
    offsets, indices = found
    assert list(zip(offsets.tolist(), indices.tolist(), strict=True)) == inside


def test_the_features_must_cover_every_placeholder() -> None:
    images = PromptImages([3, 4, 5], [-1, -2, -3], lambda: ImageFeatures(torch.zeros(2, 4), []))
    with pytest.raises(ValueError, match="2 image embeddings for 3 image tokens"):
        images.ensure_encoded()
