"""Whether bytes are an image: decided by decoding with Pillow, within the pixel limit, and named
by the SHA-256 of the bytes as they are stored."""

from __future__ import annotations

import hashlib
import io
import warnings

import pytest
from PIL import Image

from api.images.refusal import ImageRefused
from api.images.validate import ImageChecker
from tests.support.image_server import png_bytes


def _encoded(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def _refusal(checker: ImageChecker, data: bytes) -> ImageRefused:
    with pytest.raises(ImageRefused) as refused:
        checker.check(data)
    return refused.value


def test_a_png_is_named_by_its_hash_with_its_decoded_type_and_size() -> None:
    data = png_bytes(48, 40)
    checked = ImageChecker(max_pixels=10_000).check(data)
    assert checked.data == data
    ref = checked.ref
    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    assert (ref.media_type, ref.width, ref.height) == ("image/png", 48, 40)


@pytest.mark.parametrize(("image_format", "media_type"), [("JPEG", "image/jpeg"), ("GIF", "image/gif"),
                                                          ("WEBP", "image/webp")])  # fmt: skip
def test_the_type_is_what_decoding_finds(image_format: str, media_type: str) -> None:
    data = _encoded(Image.new("RGB", (5, 7), (1, 2, 3)), image_format)
    assert ImageChecker(max_pixels=100).check(data).ref.media_type == media_type


@pytest.mark.parametrize(
    "data",
    [
        b"not an image at all",
        b"",
        png_bytes()[:40],  # a PNG cut short: its header decodes, its pixels do not
        _encoded(Image.new("RGB", (4, 4)), "BMP"),  # an image, of a format not taken
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",  # EPS would run Ghostscript
    ],
)
def test_what_does_not_decode_as_a_taken_format_is_refused(data: bytes) -> None:
    assert _refusal(ImageChecker(max_pixels=10_000), data).reason == "not_an_image"


def test_the_pixel_limit_is_width_times_height() -> None:
    data = png_bytes(100, 50)
    assert ImageChecker(max_pixels=5000).check(data).ref.width == 100
    refused = _refusal(ImageChecker(max_pixels=4999), data)
    assert refused.reason == "too_many_pixels" and "100x50" in refused.message


def test_pillows_decompression_bomb_guard_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past Pillow's own limit it warns (and would decode anyway) or raises: both are refusals."""
    with warnings.catch_warnings():  # the filter the checker sets is the process's; keep it to this test
        checker = ImageChecker(max_pixels=10**9)
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
        assert _refusal(checker, png_bytes(40, 40)).reason == "too_many_pixels"  # a warning: 1600 > 1000
        assert _refusal(checker, png_bytes(50, 50)).reason == "too_many_pixels"  # an error: 2500 > 2 x 1000


def test_a_small_file_that_decodes_huge_is_refused_before_its_pixels_are() -> None:
    data = _encoded(Image.new("L", (8000, 6000)), "PNG")
    assert len(data) < 100_000
    assert _refusal(ImageChecker(max_pixels=40_000_000), data).reason == "too_many_pixels"
