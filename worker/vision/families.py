"""Each supported family's processor and vision tower, behind one small interface.

A family knows three things: the pixel inputs of one image (its processor, run where the job is
prepared), how many placeholder tokens those inputs become, and the image's embeddings (its
vision tower and projector, run on the engine thread). Its towers are transformers' own modules,
so image features are the reference implementation's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from PIL.Image import Image

PixelInputs = dict[str, torch.Tensor]


class VisionFamily(Protocol):
    image_token_id: int

    def pixel_inputs(self, image: Image) -> PixelInputs: ...

    def num_tokens(self, inputs: PixelInputs) -> int: ...

    def encode(self, inputs: PixelInputs) -> torch.Tensor:
        """``[num_tokens(inputs), hidden]`` in the language model's dtype."""
        ...


class Idefics3Family:
    """Idefics3 and SmolVLM: the image is cut into tiles plus a downscaled whole (the
    processor's splitting), each tile a fixed number of tokens after the pixel shuffle."""

    def __init__(self, processor: Any, model: Any, dtype: torch.dtype) -> None:
        self._image_processor = processor.image_processor
        self._tokens_per_tile = int(processor.image_seq_len)
        self.image_token_id = int(processor.image_token_id)
        self._model = model  # the vision tower and connector (its language model removed)
        self._dtype = dtype

    def pixel_inputs(self, image: Image) -> PixelInputs:
        batch = self._image_processor([[image]], return_tensors="pt")
        return {"pixel_values": batch["pixel_values"], "pixel_attention_mask": batch["pixel_attention_mask"]}

    def num_tokens(self, inputs: PixelInputs) -> int:
        return int(inputs["pixel_values"].shape[1]) * self._tokens_per_tile

    @torch.inference_mode()
    def encode(self, inputs: PixelInputs) -> torch.Tensor:
        device = next(self._model.parameters()).device
        features = self._model.get_image_features(
            pixel_values=inputs["pixel_values"].to(device, self._dtype),
            pixel_attention_mask=inputs["pixel_attention_mask"].to(device),
        ).pooler_output[0]
        return features.reshape(-1, features.shape[-1])


_IDEFICS3_TYPES = {"idefics3", "smolvlm"}
VISION_MODEL_TYPES = frozenset(_IDEFICS3_TYPES)


def model_type(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("model_type")
    return value if isinstance(value, str) else None


def load_family(folder: Path, dtype: torch.dtype, device: torch.device) -> tuple[VisionFamily, Any]:
    """The family of the checkpoint in ``folder`` and its processor (which holds the chat template)."""
    kind = model_type(folder)
    if kind in _IDEFICS3_TYPES:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(folder)
        full = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        tower = full.model
        del tower.text_model  # the engine's own forward runs the language model
        tower = tower.to(device).eval().requires_grad_(False)
        return Idefics3Family(processor, tower, dtype), processor
    raise ValueError(f"no vision family for model type {kind!r}")
