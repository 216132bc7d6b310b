"""One HTTP/1.1 GET over a connection the caller opened (to an address it checked): the answer's
status and headers, and a body read no further than a byte limit.

Small on purpose: a general client resolves the host itself, after the address was checked, so
a name that resolves differently the second time (DNS rebinding) would get past the check; and
none is among the API's dependencies. Only what fetching an image needs: ``Connection: close``,
no compression, a body framed by Content-Length, by chunks or by the end of the connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from api.images.refusal import ImageRefused

# A head bigger than this is no image server's (asyncio's stream limit, which readuntil obeys).
MAX_HEAD_BYTES = 64 * 1024
_READ_BYTES = 64 * 1024


@dataclass(frozen=True)
class HttpHead:
    status: int
    headers: dict[str, str]
    """Lower-cased names; a repeated header's values joined with commas."""


async def send_get(writer: asyncio.StreamWriter, host: str, target: str) -> None:
    """``host``: the Host header (the URL's host, not the address connected to)."""
    request = (
        f"GET {target} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: relaylm\r\nAccept: image/*\r\n"
        "Accept-Encoding: identity\r\nConnection: close\r\n\r\n"
    )
    writer.write(request.encode("ascii"))
    await writer.drain()


async def read_head(reader: asyncio.StreamReader) -> HttpHead:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise _failed("its headers are too long") from None
    except asyncio.IncompleteReadError:
        raise _failed("the connection closed before the headers ended") from None
    status_line, *lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise _failed("it did not answer in HTTP/1.x")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if colon:
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return HttpHead(int(code), headers)


async def read_body(reader: asyncio.StreamReader, head: HttpHead, max_bytes: int) -> bytes:
    """The body, whichever its framing; ImageRefused ``too_large`` as soon as it passes ``max_bytes``."""
    encoding = head.headers.get("transfer-encoding", "").lower()
    try:
        if encoding:
            if encoding.rsplit(",", 1)[-1].strip() != "chunked":
                raise _failed(f"it sent the body as {encoding}")
            return await _read_chunked(reader, max_bytes)
        length = head.headers.get("content-length")
        if length is not None:
            return await _read_length(reader, length, max_bytes)
        return await _read_to_end(reader, max_bytes)
    except asyncio.IncompleteReadError:
        raise _failed("the connection closed before the body ended") from None
    except asyncio.LimitOverrunError:
        raise _failed("a chunk header is too long") from None


async def _read_length(reader: asyncio.StreamReader, length: str, max_bytes: int) -> bytes:
    if not length.isdigit():  # also a repeated header with differing values
        raise _failed(f"its Content-Length is {length!r}")
    if int(length) > max_bytes:
        raise _too_large(max_bytes)
    return await reader.readexactly(int(length))


async def _read_chunked(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    body = bytearray()
    while True:
        size_text = (await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise _failed("a chunk's size is not hexadecimal") from None
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, if any
                pass
            return bytes(body)
        if len(body) + size > max_bytes:
            raise _too_large(max_bytes)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def _read_to_end(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    body = bytearray()
    while chunk := await reader.read(_READ_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(body)


def _failed(why: str) -> ImageRefused:
    return ImageRefused("fetch_failed", f"The image URL's server answered badly: {why}.")


def _too_large(max_bytes: int) -> ImageRefused:
    return ImageRefused("too_large", f"The image is larger than this server's limit of {max_bytes} bytes.")
