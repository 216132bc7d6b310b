"""Every request gets an id (the client's ``X-Request-Id`` when it is sane, else a fresh one),
returned in the ``x-request-id`` header; every response is counted by route and status."""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.metrics import Metrics

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        offered = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = offered if _CLIENT_ID.match(offered) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        scope["state"]["request_id_is_ours"] = request_id != offered
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.http_requests.labels(path, scope["method"], str(status)).inc()
