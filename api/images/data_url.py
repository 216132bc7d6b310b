"""Images in ``data:`` URLs (RFC 2397), the form every API here takes without fetching anything:
``data:image/png;base64,iVBOR...``."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from api.images.refusal import ImageRefused

# Line-wrapped base64 (76 characters a line, as MIME writes it) is still the same data.
_WHITESPACE = str.maketrans("", "", " \t\r\n")


@dataclass(frozen=True)
class DataUrl:
    media_type: str
    """As the URL says; what the bytes are is decided by decoding them."""
    data: bytes


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def parse_data_url(url: str, max_bytes: int) -> DataUrl:
    """The bytes of a base64 ``data:`` URL: ImageRefused for any other form, for base64 that is
    not, and for data over ``max_bytes`` (known from the length before anything is decoded)."""
    if not is_data_url(url):
        raise _malformed("it does not start with data:")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise _malformed("it has no comma before its data")
    params = [param.strip().lower() for param in header.split(";")]
    if params[-1] != "base64" or len(params) < 2:
        raise _malformed("an image must be base64 (data:<media type>;base64,<data>)")
    payload = payload.translate(_WHITESPACE)
    payload += "=" * (-len(payload) % 4)  # some encoders leave the padding out
    if len(payload) // 4 * 3 - payload[-2:].count("=") > max_bytes:
        raise ImageRefused("too_large", f"The image is larger than this server's limit of {max_bytes} bytes.")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):  # ValueError: a character that is not ASCII
        raise _malformed("its data is not base64") from None
    return DataUrl(media_type=params[0] or "text/plain", data=data)


def _malformed(why: str) -> ImageRefused:
    return ImageRefused("malformed_data_url", f"The image's data: URL is malformed: {why}.")
