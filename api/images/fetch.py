"""Fetching a remote image without letting its URL reach what the operator did not allow.

Each hop's host is resolved once, every address it resolves to is checked (``addresses``), and
the connection goes to the checked address, with the URL's host kept as the Host header and the
TLS server name. Redirects are followed by hand, at most ``MAX_REDIRECTS``, each target resolved
and checked again. One deadline covers the lookups, connections, redirects and download, and the
download stops as soon as it passes the byte limit.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
from dataclasses import dataclass
from ipaddress import IPv6Address, ip_address
from urllib.parse import quote, urljoin, urlsplit

from api.images.addresses import Address, AddressPolicy
from api.images.http_get import MAX_HEAD_BYTES, read_body, read_head, send_get
from api.images.refusal import ImageRefused

logger = logging.getLogger(__name__)

MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
# What a request target may hold as it is (RFC 3986's reserved and unreserved characters, and the
# '%' of escapes already made); anything else (spaces, non-ASCII) is percent-encoded.
_TARGET_SAFE = "/?#[]@!$&'()*+,;=:%-._~"
_HOST_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class Target:
    """One URL as it is fetched."""

    is_tls: bool
    host: str  # what is resolved and, with TLS, the server name checked against the certificate
    port: int
    host_header: str
    path: str  # the request target: path and query


def parse_target(url: str) -> Target:
    """An ``http(s)`` URL's parts; ImageRefused ``unsupported_url`` for anything else."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed [ of an IPv6 host
        raise _unsupported("it is not a valid URL") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise _unsupported("an image URL is a data: URL or an http(s) URL")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        raise _unsupported("its port is not a number from 0 to 65535") from None
    host = _ascii_host(parts.hostname or "")
    is_ipv6 = ":" in host
    host_header = f"[{host}]" if is_ipv6 else host
    if port != _DEFAULT_PORTS[scheme]:
        host_header += f":{port}"
    path = quote(parts.path or "/", safe=_TARGET_SAFE)
    if parts.query:
        path += "?" + quote(parts.query, safe=_TARGET_SAFE)
    return Target(scheme == "https", host, port, host_header, path)


def _ascii_host(hostname: str) -> str:
    if not hostname:
        raise _unsupported("it has no host")
    try:
        return str(ip_address(hostname))
    except ValueError:
        pass
    try:
        host = hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise _unsupported("its host is not a valid name") from None
    if not _HOST_NAME.match(host):
        raise _unsupported("its host is not a valid name")
    return host


def _unsupported(why: str) -> ImageRefused:
    return ImageRefused("unsupported_url", f"The image URL cannot be fetched: {why}.")


class RemoteFetcher:
    def __init__(
        self, policy: AddressPolicy, timeout_s: float, max_bytes: int, tls: ssl.SSLContext | None = None
    ) -> None:
        """``tls``: the system's trusted certificates unless given."""
        self._policy = policy
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._tls = tls or ssl.create_default_context()

    async def fetch(self, url: str) -> bytes:
        """The body of ``url`` (after redirects); ImageRefused for every way it cannot be had."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._follow(url)
        except TimeoutError:
            message = f"Fetching the image took longer than this server's limit of {self._timeout_s:g} s."
            raise ImageRefused("timeout", message) from None

    async def _follow(self, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            target = parse_target(url)
            address = await self._resolve(target)
            location, body = await self._get(target, address)
            if location is None:
                return body
            url = urljoin(url, location)
        raise ImageRefused("too_many_redirects", f"The image URL redirects more than {MAX_REDIRECTS} times.")

    async def _resolve(self, target: Target) -> Address:
        """The one address to connect to; every address the host has must be allowed, since which
        one a second lookup would give is not ours to say."""
        loop = asyncio.get_running_loop()
        try:
            found = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise ImageRefused("unresolvable", f"The image URL's host `{target.host}` does not resolve.") from None
        addresses = [ip_address(sockaddr[0]) for _, _, _, _, sockaddr in found]
        blocked = [address for address in addresses if not self._policy.allows(address)]
        if blocked or not addresses:
            # The client is not told which address: the answer would map the server's network.
            logger.info("image host %s refused: it resolves to %s", target.host, blocked)
            message = (
                f"The image URL's host `{target.host}` resolves to an address that is not public; images are "
                "fetched from public addresses only (and from the networks in --allowed-image-networks)."
            )
            raise ImageRefused("blocked_address", message)
        return addresses[0]

    async def _get(self, target: Target, address: Address) -> tuple[str | None, bytes]:
        """(the redirect's Location, b"") or (None, the body)."""
        host = str(address.ipv4_mapped or address) if isinstance(address, IPv6Address) else str(address)
        try:
            reader, writer = await asyncio.open_connection(
                host, target.port, limit=MAX_HEAD_BYTES,
                ssl=self._tls if target.is_tls else None, server_hostname=target.host if target.is_tls else None,
            )  # fmt: skip
        except OSError as exc:  # ssl.SSLError too
            raise ImageRefused("fetch_failed", f"Could not connect to the image URL's host: {exc}.") from None
        try:
            await send_get(writer, target.host_header, target.path)
            head = await read_head(reader)
            if head.status in _REDIRECT_STATUSES:
                location = head.headers.get("location")
                if not location:
                    raise ImageRefused("fetch_failed", f"The image URL redirects (HTTP {head.status}) nowhere.")
                return location, b""
            if head.status != 200:
                raise ImageRefused("http_status", f"The image URL answered HTTP {head.status}.")
            return None, await read_body(reader, head, self._max_bytes)
        except OSError as exc:
            raise ImageRefused("fetch_failed", f"Fetching the image failed: {exc}.") from None
        finally:
            writer.transport.abort()  # Connection: close; nothing more to read or say
