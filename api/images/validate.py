"""Whether bytes are an image this server takes: decided by decoding them with Pillow (never by a
Content-Type header or a file name), in a format vision processors read, within the pixel limit."""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image

from api.images.refusal import ImageRefused
from shared.contract import ImageRef

# The formats OpenAI and Anthropic take. Others that Pillow could open are refused unread (its EPS
# plugin runs Ghostscript, for one).
TAKEN_FORMATS = ("PNG", "JPEG", "GIF", "WEBP")


@dataclass(frozen=True)
class CheckedImage:
    data: bytes
    ref: ImageRef


class ImageChecker:
    def __init__(self, max_pixels: int) -> None:
        self.max_pixels = max_pixels
        # Pillow warns, and decodes anyway, past its own pixel limit: here that is a refusal. A
        # warnings filter is process-wide (and checks run in threads, where catch_warnings is not
        # safe), so it is set once, as the checker is made at start-up.
        warnings.filterwarnings("error", category=Image.DecompressionBombWarning)

    def check(self, data: bytes) -> CheckedImage:
        """The image's reference (SHA-256 of ``data``, type, size); ImageRefused if it is not one
        or is larger than ``max_pixels``. CPU-bound: run it in a thread."""
        try:
            with Image.open(io.BytesIO(data), formats=TAKEN_FORMATS) as image:
                width, height = image.size
                if width * height > self.max_pixels:  # before the pixels are decoded
                    raise self._too_many_pixels(f"{width}x{height}")
                image.load()
                media_type = Image.MIME[image.format or ""]
        except ImageRefused:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise self._too_many_pixels("past Pillow's decompression-bomb limit") from None
        except Exception:  # Pillow's decoders fail in many ways (OSError, SyntaxError, ValueError, ...)
            message = "The image is not a PNG, JPEG, GIF or WebP image, or it is damaged."
            raise ImageRefused("not_an_image", message) from None
        ref = ImageRef(sha256=hashlib.sha256(data).hexdigest(), media_type=media_type, width=width, height=height)
        return CheckedImage(data, ref)

    def _too_many_pixels(self, size: str) -> ImageRefused:
        message = f"The image ({size}) has more pixels than this server's limit of {self.max_pixels}."
        return ImageRefused("too_many_pixels", message)
