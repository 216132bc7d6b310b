"""Version 3 of the job contract: version 2, and chat messages that carry images.

A message's ``content`` is text, as in version 2, or, when it holds an image, its parts in
order: text and images. An image is not in the payload: its bytes (validated by the API) are
stored once under ``RedisKeys.image(sha256)``, named here by that hash, which is also what the
worker's caches key it by. Everything else is version 2's, field for field, so a version-3 job
without images is written as version 2 for a worker of that release.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from shared.contract.v2 import ChatJob as ChatJobV2
from shared.contract.v2 import CompletionJob as CompletionJobV2
from shared.contract.v2 import EmbeddingJob as EmbeddingJobV2
from shared.contract.v2 import Generate as GenerateV2
from shared.contract.v2 import Message as MessageV2
from shared.contract.v2 import Tokenize as TokenizeV2
from shared.contract.v2 import TokenizeJob as TokenizeJobV2
from shared.contract.v2 import TranscriptionJob as TranscriptionJobV2
from shared.contract.v2 import _Contract

VERSION = 3


class ImageRef(_Contract):
    """An image the API fetched, decoded and stored; its bytes are ``RedisKeys.image(sha256)``."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Of the image's bytes as stored.")
    media_type: str = Field(description="What Pillow decoded it as, e.g. image/png.")
    width: int = Field(ge=1)
    height: int = Field(ge=1)


class TextPart(_Contract):
    type: Literal["text"] = "text"
    text: str


class ImagePart(_Contract):
    type: Literal["image"] = "image"
    image: ImageRef


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(MessageV2):
    """One chat turn: ``content`` is text, or its text and image parts in order."""

    content: str | list[Part]  # type: ignore[assignment]

    @property
    def images(self) -> list[ImageRef]:
        if isinstance(self.content, str):
            return []
        return [part.image for part in self.content if isinstance(part, ImagePart)]


class Generate(GenerateV2):
    messages: list[Message] | None = None  # type: ignore[assignment]

    @property
    def images(self) -> list[ImageRef]:
        """Every image of the conversation, in order (repeats included)."""
        return [image for message in self.messages or [] for image in message.images]


class Tokenize(TokenizeV2):
    chat: Generate | None = None


class ChatJob(ChatJobV2):
    version: Literal[3] = 3  # type: ignore[assignment]
    request: Generate


class CompletionJob(CompletionJobV2):
    version: Literal[3] = 3  # type: ignore[assignment]
    request: Generate


class EmbeddingJob(EmbeddingJobV2):
    version: Literal[3] = 3  # type: ignore[assignment]


class TokenizeJob(TokenizeJobV2):
    version: Literal[3] = 3  # type: ignore[assignment]
    request: Tokenize


class TranscriptionJob(TranscriptionJobV2):
    version: Literal[3] = 3  # type: ignore[assignment]


AnyJob = ChatJob | CompletionJob | EmbeddingJob | TokenizeJob | TranscriptionJob


def images_of(job: AnyJob) -> list[ImageRef]:
    """The images a job's worker reads from Redis."""
    request = job.request
    if isinstance(request, Generate):
        return request.images
    if isinstance(request, Tokenize) and request.chat is not None:
        return request.chat.images
    return []


def upgrade_v2(data: dict[str, object]) -> dict[str, object]:
    """A version-2 payload as version 3: the same fields (a version-2 message's text content is
    version 3's text content)."""
    return {**data, "version": VERSION}


def downgrade_to_v2(job: AnyJob) -> dict[str, object]:
    """The version-2 payload of ``job``; ``ValueError`` for a job with images (version 2 has none)."""
    if images_of(job):
        raise ValueError("version 2 has no images")
    return {**job.model_dump(mode="json"), "version": 2}
