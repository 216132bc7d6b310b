"""A request's images as its job takes them: loaded and checked before the job is built
(``api/images``), named in the job by reference, their bytes stored just before it is queued."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from api.wire.openai.images import ImageLocator
from shared.contract import ImageRef


@dataclass(frozen=True)
class JobImages:
    refs: Mapping[ImageLocator, ImageRef] = field(default_factory=dict)
    """What each image part's locator names, for the job's messages."""
    data: Mapping[str, bytes] = field(default_factory=dict)
    """Each image's bytes by SHA-256, for ``JobLifecycle.store_images``."""


NO_IMAGES = JobImages()
