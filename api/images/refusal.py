"""Why an image is not taken: one exception, its reason a metric label, its message the client's."""

from __future__ import annotations

from typing import Literal

RefusalReason = Literal[
    "too_many_images",
    "not_vision",
    "malformed_data_url",
    "unsupported_url",
    "remote_off",
    "blocked_address",
    "unresolvable",
    "fetch_failed",
    "http_status",
    "too_many_redirects",
    "timeout",
    "too_large",
    "not_an_image",
    "too_many_pixels",
    "file_not_found",
]


class ImageRefused(Exception):
    """One image cannot be taken. Raised where the reason is known; the loader names the request
    part it came from (a 400) and counts the reason."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason: RefusalReason = reason
        self.message = message
