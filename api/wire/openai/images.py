"""What an image part of a request names, whichever API it came in (here, beside the chat
request, since that is what every API's request becomes).

Responses and Messages requests become chat requests before they run, and their image parts
become chat image parts; the images themselves are loaded from the request as the client wrote it,
so that a refusal names the part the client sent (``input[0].content[1]``, not the chat message
it became). Both walks meet at the :class:`ImageLocator`: the loaded image of a locator is what
the job's chat part holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageLocator:
    """Where an image is: a URL (``data:`` or ``http(s):``) or an uploaded file's id (one of them)."""

    url: str | None = None
    file_id: str | None = None


@dataclass(frozen=True)
class ImageSource:
    """One image part of a request: where its image is, and the part's path for a refusal."""

    param: str
    locator: ImageLocator
