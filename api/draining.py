"""Draining on SIGTERM (or SIGINT): the process keeps listening, but every new request except
``/health`` gets 503 + ``Retry-After`` + ``Connection: close``, so load balancers take it out and
clients retry elsewhere, while requests in flight (open SSE streams too) finish. It exits as
uvicorn always did once none is left or ``drain_timeout_s`` has passed; a second signal quits
at once.

Two parts share one :class:`DrainGate`: :class:`DrainingServer` opens the drain and decides
when to exit, :class:`DrainingMiddleware` counts requests and refuses new ones."""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import error_response
from shared.errors import ErrorKind, RelayError

logger = logging.getLogger("relaylm.api")

# Liveness still answers: the process is alive, only no longer taking work.
ANSWERED_WHILE_DRAINING = ("/health",)


class DrainGate:
    """Whether this process is draining, and how many HTTP requests are in flight. Touched only
    from the event loop's thread (signal handlers included), so plain attributes suffice."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_in_flight = 0
        self._deadline = 0.0  # time.monotonic()

    def start_draining(self, timeout_s: float) -> None:
        self.is_draining = True
        self._deadline = time.monotonic() + timeout_s

    @property
    def is_drained(self) -> bool:
        """Draining with nothing left to wait for: no request in flight, or the window is over."""
        return self.is_draining and (self.num_in_flight == 0 or time.monotonic() >= self._deadline)


class DrainingMiddleware:
    """Counts HTTP requests in flight; while draining, answers new ones with 503."""

    def __init__(self, app: ASGIApp, gate: DrainGate, retry_after_s: int) -> None:
        self.app = app
        self.gate = gate
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.gate.is_draining and scope["path"] not in ANSWERED_WHILE_DRAINING:
            await self._refuse(scope, receive, send)
            return
        self.gate.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.num_in_flight -= 1

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = "This server is shutting down; retry the request (another instance may take it)."
        error = RelayError(ErrorKind.SERVER_SHUTTING_DOWN, message, retry_after_s=self.retry_after_s)
        response = error_response(error, scope["path"])
        # A kept-alive connection would bring the client's next request back to this process.
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT starts a drain instead of closing the listener."""

    def __init__(self, config: uvicorn.Config, gate: DrainGate, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.gate = gate
        self.drain_timeout_s = drain_timeout_s
        self._is_drain_logged = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.gate.is_draining:
            super().handle_exit(sig, frame)
            self.force_exit = True  # a second signal: stop waiting for anything
            return
        # uvicorn raises the captured signal again once it has shut down, so the exit status
        # still says SIGTERM, as it did before draining existed.
        self._captured_signals.append(sig)
        self.gate.start_draining(self.drain_timeout_s)
        # Open SSE streams get drain_timeout_s to end (sse-starlette's shutdown grace); one cut
        # short leaves its job running so that the client can resume it elsewhere.
        AppStatus.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s: log the drain here rather than in the signal handler, and end it."""
        if self.gate.is_draining and not self._is_drain_logged:
            self._is_drain_logged = True
            in_flight, timeout_s = self.gate.num_in_flight, self.drain_timeout_s
            logger.info("draining: new requests get 503; %d in flight may finish (up to %.0f s)", in_flight, timeout_s)
        if self.gate.is_drained and not self.should_exit:
            logger.info("drained (%d request(s) still in flight); shutting down", self.gate.num_in_flight)
            self.should_exit = True
        return await super().on_tick(counter)
