"""Loading a request's images where the routes call it: for a model that takes images, with the
files the asking key may read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.batches.file_store import FileStore
from api.images.loader import ImageLoader
from api.images.refusal import ImageRefused
from api.jobs.images import NO_IMAGES, JobImages
from api.jobs.worker_directory import WorkerDirectory
from api.tenancy import Tenant
from api.wire.openai.images import ImageSource
from shared.errors import ErrorKind, RelayError


@dataclass(frozen=True)
class ImageIntake:
    """Loads a request's images: for a model that takes images, with the files the asking key may read."""

    loader: ImageLoader
    directory: WorkerDirectory
    files: FileStore

    async def load(self, tenant: Tenant, model: str, sources: Sequence[ImageSource]) -> JobImages:
        """The images of ``sources`` (the request's image parts, from the wire module's
        ``image_sources``), checked and ready for the job; nothing to do for a text-only request.
        404/503 for a model not served, 400 naming the model for one whose ready workers take no
        images (while its workers all load, the one that claims the job decides), 400 naming the
        part for an image refused."""
        if not sources:
            return NO_IMAGES
        loader, directory = self.loader, self.directory
        await directory.require_worker(model)
        if await directory.refuses_images(model):
            raise loader.refuse("not_vision", f"The model `{model}` does not take image input.", "model")

        async def read_file(file_id: str) -> bytes:
            return await read_image_file(self.files, file_id, tenant, loader.max_bytes)

        return await loader.load(sources, read_file)


async def read_image_file(files: FileStore, file_id: str, tenant: Tenant, max_bytes: int) -> bytes:
    """An uploaded file's bytes if ``tenant`` may read it (another key's file is refused as one
    that does not exist, as the files routes answer), and no larger than ``max_bytes``."""
    try:
        meta = await files.get(file_id, tenant)
        if meta.bytes > max_bytes:
            raise ImageRefused("too_large", f"The image is larger than this server's limit of {max_bytes} bytes.")
        return await files.content(file_id, tenant)
    except RelayError as error:
        if error.kind is not ErrorKind.NOT_FOUND:
            raise
        raise ImageRefused("file_not_found", error.message) from None
