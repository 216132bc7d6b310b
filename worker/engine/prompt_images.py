"""A prompt's images, as the engine sees them: which prompt positions hold image tokens, what
their embeddings are, and what the prefix cache names them by.

The model's processor expands each image into placeholder tokens (the same ids for every
image), so token ids alone would let two requests with different images share cached keys and
values. Every placeholder is therefore named, for hashing only, by its image's content hash and
its place in that image: a repeated image hits the cache, another image never does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# Placeholder names are negative, so they never equal a token id; 20 bits for the index within
# the image, the rest from its hash.
_INDEX_BITS = 20


def placeholder_key(sha256: str, index: int) -> int:
    """The hashing name of an image's ``index``-th placeholder token."""
    return -(((int(sha256[:16], 16) << _INDEX_BITS) | index) + 1)


class ImageFeatures(NamedTuple):
    """A prompt's image embeddings, ``[num placeholders, hidden]``, and, for models that add vision
    features inside the decoder too (Qwen3-VL's deepstack), those per layer, each the same shape."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


@dataclass
class PromptImages:
    """``positions``: the prompt indices of image placeholder tokens, ascending; ``keys``: their
    hashing names; ``encode`` (run on the engine thread, once) returns their features in the same
    order. ``rope_positions``: for multimodal RoPE, the prompt's temporal, height and width
    positions (``[3, prompt_len]``), and ``rope_delta`` what each later token's position is
    shifted by (its RoPE position is its index plus the delta)."""

    positions: list[int]
    keys: list[int]
    encode: Callable[[], ImageFeatures]
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    features: ImageFeatures | None = None
    _key_of: dict[int, int] = field(default_factory=dict, repr=False)
    _position_t: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long), repr=False)

    def __post_init__(self) -> None:
        if len(self.positions) != len(self.keys):
            raise ValueError("one key per image position")
        self._key_of = dict(zip(self.positions, self.keys, strict=True))
        self._position_t = torch.tensor(self.positions, dtype=torch.long)  # read by every prefill chunk

    def ensure_encoded(self) -> ImageFeatures:
        if self.features is None:
            features = self.encode()
            if features.embeds.shape[0] != len(self.positions):
                count = features.embeds.shape[0]
                raise ValueError(f"{count} image embeddings for {len(self.positions)} image tokens")
            self.features = features
        return self.features

    def keyed(self, token_ids: list[int]) -> list[int]:
        """``token_ids`` (a prompt, then outputs) with every image position named by its key."""
        keyed = list(token_ids)
        for position, key in self._key_of.items():
            if position < len(keyed):
                keyed[position] = key
        return keyed

    def rows_in(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Image positions within ``[start, start + length)``: their offsets from ``start`` and
        the indices of their embeddings; None when there are none."""
        positions = self._position_t
        inside = (positions >= start) & (positions < start + length)
        if not bool(inside.any()):
            return None
        indices = inside.nonzero().flatten()
        return positions[indices] - start, indices
