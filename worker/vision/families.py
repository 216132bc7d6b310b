"""Each supported family's processor and vision tower, behind one small interface.

A family knows: the pixel inputs of one image and how many placeholder tokens they become (its
image processor, run where the job is prepared), the prompt's token ids with every image marker
expanded into those placeholders, the positions multimodal RoPE rotates by where the family uses
it, and an image's features (its vision tower and projector, run on the engine thread). Towers
are transformers' own modules, so image features are the reference implementation's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from worker.engine.prompt_images import ImageFeatures

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import PreTrainedTokenizerBase

PixelInputs = dict[str, torch.Tensor]


class VisionFamily(Protocol):
    image_token_id: int
    chat_template: str | None  # where the checkpoint keeps it beside the processor, not the tokenizer

    def pixel_inputs(self, image: Image) -> PixelInputs: ...

    def num_tokens(self, inputs: PixelInputs) -> int: ...

    def prompt_ids(self, text: str, images: list[Image], inputs: list[PixelInputs]) -> list[int]:
        """The rendered chat text's token ids, each image marker expanded into its placeholders."""
        ...

    def rope_positions(self, token_ids: list[int], inputs: list[PixelInputs]) -> tuple[torch.Tensor, int] | None:
        """Multimodal RoPE's ``[3, len(token_ids)]`` positions and the shift of later tokens; None
        for a family on plain RoPE."""
        ...

    def encode(self, inputs: PixelInputs) -> ImageFeatures:
        """One image's features, ``[num_tokens(inputs), hidden]`` in the language model's dtype."""
        ...


class Idefics3Family:
    """Idefics3 and SmolVLM: the image is cut into tiles plus a downscaled whole (the processor's
    splitting), each tile a fixed number of tokens after the pixel shuffle; plain RoPE."""

    def __init__(self, processor: Any, model: Any, dtype: torch.dtype) -> None:
        self._processor = processor
        self._tokens_per_tile = int(processor.image_seq_len)
        self.image_token_id = int(processor.image_token_id)
        self.chat_template = getattr(processor, "chat_template", None)
        self._model = model  # the vision tower and connector (its language model removed)
        self._dtype = dtype

    def pixel_inputs(self, image: Image) -> PixelInputs:
        batch = self._processor.image_processor([[image]], return_tensors="pt")
        return {"pixel_values": batch["pixel_values"], "pixel_attention_mask": batch["pixel_attention_mask"]}

    def num_tokens(self, inputs: PixelInputs) -> int:
        return int(inputs["pixel_values"].shape[1]) * self._tokens_per_tile

    def prompt_ids(self, text: str, images: list[Image], inputs: list[PixelInputs]) -> list[int]:
        batch = self._processor(text=[text], images=[images] if images else None, return_tensors="pt")
        ids: list[int] = batch["input_ids"][0].tolist()
        return ids

    def rope_positions(self, token_ids: list[int], inputs: list[PixelInputs]) -> tuple[torch.Tensor, int] | None:
        return None

    @torch.inference_mode()
    def encode(self, inputs: PixelInputs) -> ImageFeatures:
        device = next(self._model.parameters()).device
        features = self._model.get_image_features(
            pixel_values=inputs["pixel_values"].to(device, self._dtype),
            pixel_attention_mask=inputs["pixel_attention_mask"].to(device),
        ).pooler_output[0]
        return ImageFeatures(features.reshape(-1, features.shape[-1]), [])


class QwenVLFamily:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: an image is resized to a grid of patches, merged
    ``merge_size``² at a time into one placeholder each, between vision start and end tokens; the
    language model rotates by temporal, height and width positions (multimodal RoPE); Qwen3-VL
    also adds features of early tower layers to the first decoder layers (deepstack).

    Prompts are expanded here, as transformers' Qwen-VL processors do (one ``<|image_pad|>`` per
    merged patch), so the processors' video half, which needs torchvision, is never built."""

    def __init__(self, image_processor: Any, tokenizer: PreTrainedTokenizerBase, model: Any, dtype: torch.dtype,
                 image_token_id: int, chat_template: str | None) -> None:  # fmt: skip
        self._image_processor = image_processor
        self._merge = int(image_processor.merge_size)
        self._tokenizer = tokenizer
        self._model = model  # the vision tower (its language model removed)
        self._dtype = dtype
        self.image_token_id = image_token_id
        self._image_token = str(tokenizer.convert_ids_to_tokens(image_token_id))
        self.chat_template = chat_template

    def pixel_inputs(self, image: Image) -> PixelInputs:
        batch = self._image_processor(images=[image], return_tensors="pt")
        return {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}

    def num_tokens(self, inputs: PixelInputs) -> int:
        return int(inputs["image_grid_thw"][0].prod()) // self._merge**2

    def prompt_ids(self, text: str, images: list[Image], inputs: list[PixelInputs]) -> list[int]:
        pieces = text.split(self._image_token)
        if len(pieces) != len(inputs) + 1:
            return []  # the caller finds the placeholders do not match the images
        expanded = [pieces[0]]
        for one, piece in zip(inputs, pieces[1:], strict=True):
            expanded.append(self._image_token * self.num_tokens(one) + piece)
        ids: list[int] = self._tokenizer.encode("".join(expanded), add_special_tokens=False)
        return ids

    def rope_positions(self, token_ids: list[int], inputs: list[PixelInputs]) -> tuple[torch.Tensor, int] | None:
        """Text tokens count on by one in all three streams; an image's placeholders take the
        position where it starts plus their row (height) and column (width), and the text after
        it continues from its start plus its larger side."""
        positions = torch.empty(3, len(token_ids), dtype=torch.long)
        grids = iter(inputs)
        index, current = 0, 0
        while index < len(token_ids):
            if token_ids[index] != self.image_token_id:
                positions[:, index] = current
                index, current = index + 1, current + 1
                continue
            _, height, width = (int(n) for n in next(grids)["image_grid_thw"][0])
            rows, cols = height // self._merge, width // self._merge
            grid_rows = torch.arange(rows).repeat_interleave(cols)
            grid_cols = torch.arange(cols).repeat(rows)
            count = rows * cols
            positions[0, index : index + count] = current
            positions[1, index : index + count] = current + grid_rows
            positions[2, index : index + count] = current + grid_cols
            index, current = index + count, current + max(rows, cols)
        return positions, int(positions.max()) + 1 - len(token_ids) if token_ids else 0

    @torch.inference_mode()
    def encode(self, inputs: PixelInputs) -> ImageFeatures:
        device = next(self._model.parameters()).device
        output = self._model.get_image_features(
            pixel_values=inputs["pixel_values"].to(device, self._dtype),
            image_grid_thw=inputs["image_grid_thw"].to(device),
        )
        embeds = torch.cat(list(output.pooler_output))
        deepstack = [torch.cat(list(layer)) for layer in getattr(output, "deepstack_features", None) or []]
        return ImageFeatures(embeds, deepstack)


_IDEFICS3_TYPES = {"idefics3", "smolvlm"}
_QWEN_TYPES = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
VISION_MODEL_TYPES = frozenset(_IDEFICS3_TYPES | _QWEN_TYPES)


def model_type(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("model_type")
    return value if isinstance(value, str) else None


def _tower(folder: Path, dtype: torch.dtype, device: torch.device, language_model: str) -> Any:
    """transformers' model of the checkpoint without its language model (the engine runs that)."""
    from transformers import AutoModelForImageTextToText

    full = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    tower = full.model
    delattr(tower, language_model)
    return tower.to(device).eval().requires_grad_(False)


def load_family(
    folder: Path, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype, device: torch.device
) -> VisionFamily:
    """The family of the checkpoint in ``folder``; ``ValueError`` naming what is missing."""
    kind = model_type(folder)
    if kind in _IDEFICS3_TYPES:
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(folder)
        except (AttributeError, ImportError) as exc:  # SmolVLM2's processor has a video half
            raise ValueError(f"the {kind} processor could not be built ({exc}); pip install torchvision") from exc
        return Idefics3Family(processor, _tower(folder, dtype, device, "text_model"), dtype)
    if kind in _QWEN_TYPES:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        settings = json.loads((folder / "preprocessor_config.json").read_text())
        settings.pop("image_processor_type", None)
        settings.pop("processor_class", None)
        image_processor = Qwen2VLImageProcessorPil(**settings)
        config = json.loads((folder / "config.json").read_text())
        template_file = folder / "chat_template.json"
        template = json.loads(template_file.read_text()).get("chat_template") if template_file.is_file() else None
        tower = _tower(folder, dtype, device, "language_model")
        return QwenVLFamily(image_processor, tokenizer, tower, dtype, int(config["image_token_id"]), template)
    raise ValueError(f"no vision family for model type {kind!r}")
