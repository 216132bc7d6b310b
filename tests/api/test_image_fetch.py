"""Fetching remote images against a real HTTP server on 127.0.0.1: reachable only through the
allowlist, redirects re-checked and bounded, the body bounded, a deadline; the name resolved once
and the connection made to the checked address."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest

from api.images.addresses import AddressPolicy
from api.images.fetch import MAX_REDIRECTS, RemoteFetcher, parse_target
from api.images.refusal import ImageRefused
from tests.support.image_server import ImageServer, Reply, image_server, png_bytes

LOOPBACK_ONLY = AddressPolicy([ip_network("127.0.0.1/32")])
MAX_BYTES = 50_000
PNG = png_bytes(16, 12)


@pytest.fixture
def server() -> Iterator[ImageServer]:
    with image_server() as running:
        running.replies["/img.png"] = Reply(body=PNG, headers={"Content-Type": "image/png"})
        yield running


def _fetcher(policy: AddressPolicy = LOOPBACK_ONLY, timeout_s: float = 5.0) -> RemoteFetcher:
    return RemoteFetcher(policy, timeout_s, MAX_BYTES)


async def _refusal(url: str, fetcher: RemoteFetcher | None = None) -> ImageRefused:
    with pytest.raises(ImageRefused) as refused:
        await (fetcher or _fetcher()).fetch(url)
    return refused.value


async def test_an_allowlisted_loopback_server_is_fetched(server: ImageServer) -> None:
    assert await _fetcher().fetch(server.url("/img.png")) == PNG
    headers = server.seen[0].headers
    assert headers["host"] == f"127.0.0.1:{server.port}"
    assert headers["accept-encoding"] == "identity" and headers["connection"] == "close"


async def test_loopback_is_refused_without_the_allowlist(server: ImageServer) -> None:
    refused = await _refusal(server.url("/img.png"), _fetcher(AddressPolicy()))
    assert refused.reason == "blocked_address"
    assert server.seen == []  # refused before connecting


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.2:{port}/img.png",  # loopback, but not the allowlisted 127.0.0.1
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:{port}/img.png",
        "http://[::ffff:10.0.0.1]/x",
        "http://0.0.0.0/",
    ],
)
async def test_a_redirect_to_an_address_not_allowed_is_refused(server: ImageServer, target: str) -> None:
    server.replies["/hop"] = Reply(status=302, headers={"Location": target.format(port=server.port)})
    assert (await _refusal(server.url("/hop"))).reason == "blocked_address"
    assert [seen.path for seen in server.seen] == ["/hop"]


@pytest.mark.parametrize("target", ["ftp://127.0.0.1/img.png", "file:///etc/passwd", "data:image/png;base64,aGk="])
async def test_a_redirect_to_another_scheme_is_refused(server: ImageServer, target: str) -> None:
    server.replies["/hop"] = Reply(status=301, headers={"Location": target})
    assert (await _refusal(server.url("/hop"))).reason == "unsupported_url"


def _chain(server: ImageServer, num_redirects: int) -> str:
    """A path that redirects ``num_redirects`` times (relative and absolute Locations) to the image."""
    for hop in range(num_redirects):
        following = "/img.png" if hop == num_redirects - 1 else f"/r{hop + 1}"
        location = following if hop % 2 else server.url(following)
        server.replies[f"/r{hop}"] = Reply(status=(301, 302, 303, 307, 308)[hop % 5], headers={"Location": location})
    return "/r0"


async def test_up_to_the_redirect_limit_is_followed(server: ImageServer) -> None:
    assert await _fetcher().fetch(server.url(_chain(server, MAX_REDIRECTS))) == PNG
    assert len(server.seen) == MAX_REDIRECTS + 1


async def test_one_redirect_more_is_refused(server: ImageServer) -> None:
    refused = await _refusal(server.url(_chain(server, MAX_REDIRECTS + 1)))
    assert refused.reason == "too_many_redirects"
    assert len(server.seen) == MAX_REDIRECTS + 1  # the image itself is never asked for


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_the_body_limit_holds_however_the_body_is_framed(server: ImageServer, framing: Any) -> None:
    server.replies["/exact"] = Reply(body=b"x" * MAX_BYTES, framing=framing)
    assert len(await _fetcher().fetch(server.url("/exact"))) == MAX_BYTES
    server.replies["/big"] = Reply(body=b"x" * (MAX_BYTES * 20 + 1), framing=framing)
    assert (await _refusal(server.url("/big"))).reason == "too_large"


async def test_an_error_status_is_refused(server: ImageServer) -> None:
    refused = await _refusal(server.url("/missing"))
    assert refused.reason == "http_status" and "404" in refused.message


async def test_a_slow_server_meets_the_deadline(server: ImageServer) -> None:
    server.replies["/slow"] = Reply(body=PNG, delay_s=3.0)
    started = time.monotonic()
    refused = await _refusal(server.url("/slow"), _fetcher(timeout_s=0.3))
    assert refused.reason == "timeout" and time.monotonic() - started < 2.0


async def test_a_closed_port_is_a_fetch_failure() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert (await _refusal(f"http://127.0.0.1:{port}/img.png")).reason == "fetch_failed"


class _Resolver:
    """Stands in for the loop's getaddrinfo: named hosts resolve to the given addresses."""

    def __init__(self, loop: asyncio.AbstractEventLoop, names: dict[str, list[str]]) -> None:
        self.names = names
        self.asked: list[str] = []
        self._real = loop.getaddrinfo

    async def __call__(self, host: str, port: int, **kwargs: Any) -> list[Any]:
        if host not in self.names:  # the address the fetcher connects to
            return await self._real(host, port, **kwargs)
        self.asked.append(host)
        if not self.names[host]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in self.names[host]]  # fmt: skip


@pytest.fixture
async def resolver(monkeypatch: pytest.MonkeyPatch) -> _Resolver:
    loop = asyncio.get_running_loop()
    names = {"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"], "split.test": ["127.0.0.1", "10.0.0.1"],
             "none.test": []}  # fmt: skip
    fake = _Resolver(loop, names)
    monkeypatch.setattr(loop, "getaddrinfo", fake)
    return fake


async def test_a_name_is_resolved_once_and_its_address_connected_to(server: ImageServer, resolver: _Resolver) -> None:
    assert await _fetcher().fetch(server.url("/img.png", host="images.test")) == PNG
    assert resolver.asked == ["images.test"]
    assert server.seen[0].headers["host"] == f"images.test:{server.port}"  # the Host header stays the name


async def test_a_name_with_any_address_not_allowed_is_refused(server: ImageServer, resolver: _Resolver) -> None:
    refused = await _refusal(server.url("/img.png", host="split.test"))
    assert refused.reason == "blocked_address"
    assert "10.0.0.1" not in refused.message  # the client is not told where the server's names point
    assert server.seen == []


async def test_a_name_that_does_not_resolve_is_refused(resolver: _Resolver) -> None:
    assert (await _refusal("http://none.test/img.png")).reason == "unresolvable"


def _certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for ``name`` and its key (openssl's command line)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_tls_checks_the_urls_name_on_the_connection_to_the_resolved_address(
    tmp_path: Path, resolver: _Resolver
) -> None:
    cert, key = _certificate(tmp_path, "images.test")
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    fetcher = RemoteFetcher(LOOPBACK_ONLY, 5.0, MAX_BYTES, tls=ssl.create_default_context(cafile=str(cert)))
    with image_server(tls=server_tls) as server:
        server.replies["/img.png"] = Reply(body=PNG)
        assert await fetcher.fetch(server.url("/img.png", host="images.test")) == PNG
        assert server.seen[0].headers["host"] == f"images.test:{server.port}"
        # The same address under a name the certificate does not carry: refused by the TLS check.
        refused = await _refusal(server.url("/img.png", host="other.test"), fetcher)
        assert refused.reason == "fetch_failed" and "certificate" in refused.message.lower()
        assert len(server.seen) == 1


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "file:///etc/passwd", "http:///a.png", "http://example.com:99999/a.png",
            "http://[::1/a.png", "gopher://127.0.0.1:70/_x", "http://exa mple.com/"],
)  # fmt: skip
def test_urls_that_are_not_http_are_refused(url: str) -> None:
    with pytest.raises(ImageRefused) as refused:
        parse_target(url)
    assert refused.value.reason == "unsupported_url"


def test_the_request_target_and_host_header() -> None:
    target = parse_target("https://Bücher.example:8443/a b/é.png?size=2&x=%20#frag")
    assert (target.is_tls, target.host, target.port) == (True, "xn--bcher-kva.example", 8443)
    assert target.host_header == "xn--bcher-kva.example:8443"
    assert target.path == "/a%20b/%C3%A9.png?size=2&x=%20"
    assert parse_target("http://[::1]/").host_header == "[::1]"
    assert parse_target("http://example.com").path == "/"
