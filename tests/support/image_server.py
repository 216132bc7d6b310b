"""A small HTTP server on 127.0.0.1, in a thread, for image-fetching tests: each path answers
with the :class:`Reply` set for it (status, headers, body, a delay, and how the body is framed),
and every request's path and headers are kept."""

from __future__ import annotations

import io
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

from PIL import Image


def png_bytes(width: int = 8, height: int = 6, color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    framing: Literal["length", "chunked", "close"] = "length"


@dataclass
class SeenRequest:
    path: str
    headers: dict[str, str]


class ImageServer:
    def __init__(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        """``tls``: serve HTTPS with this server context."""
        self.replies: dict[str, Reply] = {}
        self.seen: list[SeenRequest] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server.seen.append(SeenRequest(self.path, {k.lower(): v for k, v in self.headers.items()}))
                reply = server.replies.get(self.path, Reply(status=404, body=b"no such path"))
                time.sleep(reply.delay_s)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                if reply.framing == "length":
                    self.send_header("Content-Length", str(len(reply.body)))
                elif reply.framing == "chunked":
                    self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                if reply.framing == "chunked":
                    for start in range(0, len(reply.body), 1000):
                        piece = reply.body[start : start + 1000]
                        self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.wfile.write(reply.body)
                self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up (a timeout test) closes the socket under a reply

        self._server = Server((host, 0), Handler)
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.port = int(self._server.server_address[1])
        self.host = host
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)

    def url(self, path: str, host: str | None = None) -> str:
        scheme = "https" if isinstance(self._server.socket, ssl.SSLSocket) else "http"
        return f"{scheme}://{host or self.host}:{self.port}{path}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def image_server(tls: ssl.SSLContext | None = None) -> Iterator[ImageServer]:
    server = ImageServer(tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.stop()
