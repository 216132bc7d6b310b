"""ASGI middleware that guards every route before FastAPI sees a request: API keys, body size,
and text hygiene (invalid UTF-8 and lone surrogates are 400s, never 500s downstream)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response
from api.tenancy import KeyRing
from shared.errors import ErrorKind, RelayError

_BODY_METHODS = {"POST", "PUT", "PATCH"}


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route except the exempt ones (liveness); the
    request's tenant (whose objects it may see) goes into ``scope["state"]["tenant"]``."""

    def __init__(self, app: ASGIApp, keyring: KeyRing, exempt_paths: Iterable[str]) -> None:
        self.app = app
        self._keyring = keyring
        self._exempt = set(exempt_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._exempt or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":  # Anthropic's SDK sends x-api-key instead
            token = headers.get(b"x-api-key", b"")
        found = self._keyring.match(token.strip()) if token.strip() else None
        if found is None:
            error = RelayError(
                ErrorKind.UNAUTHORIZED,
                "Missing or invalid API key: send Authorization: Bearer <key> (or x-api-key: <key>).",
            )
            response = error_response(error, scope["path"])
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        try:
            tenant = await self._keyring.tenant(*found)
        except RelayError as error:
            await error_response(error, scope["path"])(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class BodyGuardMiddleware:
    """Reads request bodies up to ``max_body_bytes`` (413 beyond), checks JSON bodies for invalid
    UTF-8 and lone surrogates, then replays the body to the application."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        """``path_limits``: larger limits for some paths (file uploads)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        limit = self._path_limits.get(scope["path"], self.max_body_bytes)
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
            if declared > limit:
                raise self._too_large(limit)
            body, more = await self._read_body(receive, limit)
            if b"json" in headers.get(b"content-type", b"application/json"):
                check_json_text(body)
        except RelayError as error:
            await error_response(error, scope["path"])(scope, receive, send)
            return
        await self.app(scope, _replay(body, more, receive), send)

    async def _read_body(self, receive: Receive, limit: int) -> tuple[bytes, list[Message]]:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), [message]
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self._too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), []

    @staticmethod
    def _too_large(limit: int) -> RelayError:
        return RelayError(ErrorKind.PAYLOAD_TOO_LARGE, f"Request body exceeds the limit of {limit} bytes.")


def _replay(body: bytes, pending: list[Message], receive: Receive) -> Receive:
    """A receive() that yields the buffered body first, then defers to the real one."""
    queue: list[Message] = [{"type": "http.request", "body": body, "more_body": False}, *pending]

    async def replay() -> Message:
        return queue.pop(0) if queue else await receive()

    return replay


def check_json_text(body: bytes) -> None:
    """400 for bodies that are not UTF-8 or that smuggle lone surrogates in \\u escapes."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"The request body is not valid UTF-8 (byte {exc.start}).") from exc
    if "\\u" not in text:
        return  # lone surrogates can only arrive as \u escapes
    try:
        document = json.loads(text)
    except ValueError:
        return  # FastAPI reports malformed JSON with its position
    path = lone_surrogate_path(document, [])
    if path is not None:
        raise RelayError(
            ErrorKind.INVALID_REQUEST,
            "Text contains a lone UTF-16 surrogate; send valid Unicode.",
            ".".join(path) or None,
        )


def lone_surrogate_path(value: Any, path: list[str]) -> list[str] | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items: Iterable[tuple[str, Any]] = value.items()
    elif isinstance(value, list):
        items = ((str(index), item) for index, item in enumerate(value))
    else:
        return None
    for key, item in items:
        # A key may itself hold the surrogate: the path names it escaped, so the error can be sent.
        where = [*path, str(key).encode("utf-8", "backslashreplace").decode("utf-8")]
        found = lone_surrogate_path(key, where) if isinstance(key, str) else None
        found = found or lone_surrogate_path(item, where)
        if found is not None:
            return found
    return None
