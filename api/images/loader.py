"""A request's image parts → the images its job names: each distinct image loaded once (the parts
concurrently), from a data: URL, a remote URL or an uploaded file, then checked by decoding it.
The first refusal is a 400 naming the part it came from; every refusal is counted by reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from api.images.addresses import AddressPolicy
from api.images.data_url import is_data_url, parse_data_url
from api.images.fetch import RemoteFetcher, parse_target
from api.images.refusal import ImageRefused, RefusalReason
from api.images.validate import CheckedImage, ImageChecker
from api.jobs.images import NO_IMAGES, JobImages
from api.metrics import Metrics
from api.settings import ApiSettings
from api.wire.openai.images import ImageLocator, ImageSource
from shared.errors import ErrorKind, RelayError

FileReader = Callable[[str], Awaitable[bytes]]
"""An uploaded file's bytes by id, as the asking key may read them (ImageRefused otherwise)."""


class ImageLoader:
    def __init__(self, settings: ApiSettings, metrics: Metrics) -> None:
        self.max_images = settings.max_images_per_request
        self.max_bytes = settings.max_image_bytes
        self._checker = ImageChecker(settings.max_image_pixels)
        self._fetcher = (
            RemoteFetcher(AddressPolicy(settings.image_networks), settings.image_fetch_timeout_s, self.max_bytes)
            if settings.allow_remote_images
            else None
        )
        self._metrics = metrics

    async def load(self, sources: Sequence[ImageSource], read_file: FileReader) -> JobImages:
        """The images of ``sources`` (a request's image parts, in order); RelayError (400)
        naming the part of the first refusal."""
        if not sources:
            return NO_IMAGES
        if len(sources) > self.max_images:
            refused = ImageRefused("too_many_images", f"A request holds at most {self.max_images} images.")
            raise self.refusal(refused, sources[self.max_images].param)
        firsts: dict[ImageLocator, ImageSource] = {}
        for source in sources:
            firsts.setdefault(source.locator, source)
        tasks = [asyncio.create_task(self._load_one(source, read_file)) for source in firsts.values()]
        try:
            checked = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # the first refusal stops the others' downloads
                task.cancel()
        self._metrics.request_images.observe(len(sources))
        return JobImages(
            refs={locator: image.ref for locator, image in zip(firsts, checked, strict=True)},
            data={image.ref.sha256: image.data for image in checked},
        )

    def refusal(self, refused: ImageRefused, param: str) -> RelayError:
        """The 400 of a refused image part, counted."""
        return self.refuse(refused.reason, refused.message, param)

    def refuse(self, reason: RefusalReason, message: str, param: str) -> RelayError:
        self._metrics.image_refusals.labels(reason).inc()
        return RelayError(ErrorKind.INVALID_REQUEST, message, param)

    async def _load_one(self, source: ImageSource, read_file: FileReader) -> CheckedImage:
        try:
            data, origin = await self._bytes(source.locator, read_file)
            checked = await asyncio.to_thread(self._checker.check, data)
        except ImageRefused as refused:
            raise self.refusal(refused, source.param) from None
        self._metrics.images.labels(origin).inc()
        return checked

    async def _bytes(self, locator: ImageLocator, read_file: FileReader) -> tuple[bytes, str]:
        """The image's bytes and where they came from (the metric's label)."""
        if locator.file_id is not None:
            return await read_file(locator.file_id), "file"
        url = locator.url or ""
        if is_data_url(url):
            return (await asyncio.to_thread(parse_data_url, url, self.max_bytes)).data, "data"
        parse_target(url)  # a URL of another scheme is refused as such, remote images on or off
        if self._fetcher is None:
            message = "Remote image URLs are off on this server (--allow-remote-images); send the image as a data: URL."
            raise ImageRefused("remote_off", message)
        started = time.monotonic()
        data = await self._fetcher.fetch(url)
        self._metrics.image_fetch_time.observe(time.monotonic() - started)
        return data, "remote"
