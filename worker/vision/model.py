"""A vision-language model's image side: prompts with images become token ids and the engine's
``PromptImages``; each image's embeddings are kept by content hash, so an image sent again (the
next turn of a conversation, another request) is not encoded again."""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shared.contract import ImageRef
from shared.errors import ErrorKind, RelayError
from worker.engine.prompt_images import ImageFeatures, PromptImages, placeholder_key
from worker.vision.families import PixelInputs, VisionFamily

logger = logging.getLogger(__name__)


@dataclass
class VisionStats:
    """Counted on the engine thread, read by the heartbeat (plain ints and floats: no lock needed)."""

    images_encoded: int = 0
    image_cache_hits: int = 0
    encode_seconds: float = 0.0


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    """torch's thread count for the block (the engine thread's count is restored after it)."""
    if num_threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class VisionModel:
    """``single_thread``: encode on one thread, so an image's features (computed by the library's
    kernels, not the exact ones) do not depend on how many threads the worker has at the moment:
    with ``--deterministic on``, a request continued on another worker of the same CPU reads the
    same features."""

    def __init__(self, family: VisionFamily, single_thread: bool = False, max_cached_images: int = 64) -> None:
        self.family = family
        self._threads = 1 if single_thread else None
        self.stats = VisionStats()
        self._max_cached = max_cached_images
        self._features: OrderedDict[str, ImageFeatures] = OrderedDict()  # engine thread only

    def prompt(
        self, text: str, images: list[ImageRef], image_bytes: dict[str, bytes]
    ) -> tuple[list[int], PromptImages]:
        """Token ids of the rendered chat ``text`` (one image marker per image, in order), and
        its images for the engine. Runs where the job is prepared: image processing only."""
        from PIL import Image, UnidentifiedImageError

        decoded = []
        for ref in images:
            data = image_bytes.get(ref.sha256)
            if data is None:
                raise RelayError(ErrorKind.EXPIRED, f"The image {ref.sha256[:12]}… expired before a worker took it.")
            try:
                with Image.open(io.BytesIO(data)) as image:
                    decoded.append(image.convert("RGB"))
            except (UnidentifiedImageError, OSError) as exc:
                raise RelayError(ErrorKind.INVALID_REQUEST, f"An image could not be decoded: {exc}") from exc
        family = self.family
        inputs = [family.pixel_inputs(image) for image in decoded]
        token_ids = family.prompt_ids(text, decoded, inputs)
        counts = [family.num_tokens(one) for one in inputs]
        positions = [i for i, token in enumerate(token_ids) if token == family.image_token_id]
        if not token_ids or len(positions) != sum(counts):
            raise RelayError(ErrorKind.INVALID_REQUEST, "The prompt's image markers do not match its images.")
        keys = [placeholder_key(ref.sha256, index) for ref, count in zip(images, counts, strict=True)
                for index in range(count)]  # fmt: skip
        shas = [ref.sha256 for ref in images]
        rope = family.rope_positions(token_ids, inputs) if positions else None
        prompt_images = PromptImages(positions, keys, lambda: self._encode(shas, inputs))
        if rope is not None:
            prompt_images.rope_positions, prompt_images.rope_delta = rope
        return token_ids, prompt_images

    def _encode(self, shas: list[str], inputs: list[PixelInputs]) -> ImageFeatures:
        """Engine thread: every image's features, from the cache where it has them."""
        parts = []
        for sha, one in zip(shas, inputs, strict=True):
            cached = self._features.get(sha)
            if cached is not None:
                self._features.move_to_end(sha)
                self.stats.image_cache_hits += 1
                parts.append(cached)
                continue
            started = time.perf_counter()
            with _torch_threads(self._threads):
                features = self.family.encode(one)
            self.stats.encode_seconds += time.perf_counter() - started
            self.stats.images_encoded += 1
            self._features[sha] = features
            while len(self._features) > self._max_cached:
                self._features.popitem(last=False)
            parts.append(features)
        embeds = torch.cat([part.embeds for part in parts])
        deepstack = [torch.cat(layer) for layer in zip(*(part.deepstack for part in parts), strict=True)]
        return ImageFeatures(embeds, deepstack)
