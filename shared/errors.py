"""One error table for HTTP responses and stream error events alike.

A failure is named by an :class:`ErrorKind`; the table gives its HTTP status, the OpenAI
``type`` and the default ``code``. The API turns a :class:`RelayError` into an HTTP error
body before a stream starts, or into one ``data: {"error": ...}`` event after it started;
a worker sends the same kind inside an error event.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ErrorKind(StrEnum):
    INVALID_REQUEST = "invalid_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "permission_denied"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    QUEUE_FULL = "queue_full"
    KEY_LIMIT_REACHED = "rate_limit_exceeded"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    NO_LIVE_WORKER = "no_live_worker"
    WORKER_LOST = "worker_lost"
    WORKER_SHUTTING_DOWN = "worker_shutting_down"
    SERVER_SHUTTING_DOWN = "server_shutting_down"
    STREAM_GAP = "stream_gap"
    EVENT_UNREADABLE = "event_unreadable"
    JOB_TIMEOUT = "job_timeout"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REDIS_UNAVAILABLE = "redis_unavailable"
    INTERNAL = "internal_error"


@dataclass(frozen=True)
class ErrorSpec:
    status: int
    type: str
    code: str | None


ERROR_TABLE: dict[ErrorKind, ErrorSpec] = {
    ErrorKind.INVALID_REQUEST: ErrorSpec(400, "invalid_request_error", None),
    ErrorKind.UNAUTHORIZED: ErrorSpec(401, "authentication_error", "invalid_api_key"),
    ErrorKind.FORBIDDEN: ErrorSpec(403, "permission_error", "permission_denied"),
    ErrorKind.PAYLOAD_TOO_LARGE: ErrorSpec(413, "invalid_request_error", "payload_too_large"),
    ErrorKind.QUEUE_FULL: ErrorSpec(429, "rate_limit_error", "queue_full"),
    ErrorKind.KEY_LIMIT_REACHED: ErrorSpec(429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: ErrorSpec(400, "invalid_request_error", "context_length_exceeded"),
    ErrorKind.MODEL_NOT_FOUND: ErrorSpec(404, "invalid_request_error", "model_not_found"),
    ErrorKind.NOT_FOUND: ErrorSpec(404, "invalid_request_error", "not_found"),
    ErrorKind.METHOD_NOT_ALLOWED: ErrorSpec(405, "invalid_request_error", "method_not_allowed"),
    ErrorKind.CONFLICT: ErrorSpec(409, "invalid_request_error", "conflict"),
    ErrorKind.NO_LIVE_WORKER: ErrorSpec(503, "service_unavailable_error", "no_live_worker"),
    ErrorKind.WORKER_LOST: ErrorSpec(503, "service_unavailable_error", "worker_lost"),
    ErrorKind.WORKER_SHUTTING_DOWN: ErrorSpec(503, "service_unavailable_error", "worker_shutting_down"),
    ErrorKind.SERVER_SHUTTING_DOWN: ErrorSpec(503, "service_unavailable_error", "server_shutting_down"),
    ErrorKind.STREAM_GAP: ErrorSpec(502, "server_error", "stream_gap"),
    ErrorKind.EVENT_UNREADABLE: ErrorSpec(502, "server_error", "event_unreadable"),
    ErrorKind.JOB_TIMEOUT: ErrorSpec(504, "server_error", "job_timeout"),
    # Ends in a job's log only (the client that asked for it is gone, or asked for the cancel).
    ErrorKind.CANCELLED: ErrorSpec(499, "invalid_request_error", "cancelled"),
    ErrorKind.EXPIRED: ErrorSpec(408, "invalid_request_error", "expired"),
    ErrorKind.REDIS_UNAVAILABLE: ErrorSpec(503, "service_unavailable_error", "redis_unavailable"),
    ErrorKind.INTERNAL: ErrorSpec(500, "server_error", "internal_error"),
}


class RelayError(Exception):
    """A failure with a known kind: raised anywhere, rendered once by the API."""

    def __init__(
        self, kind: ErrorKind, message: str, param: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def spec(self) -> ErrorSpec:
        return ERROR_TABLE[self.kind]

    @property
    def status(self) -> int:
        return self.spec.status

    def to_anthropic_body(self) -> dict[str, Any]:
        """The Anthropic error object, for the Messages API: ``{"type": "error", "error": {"type",
        "message"}}``, its type chosen by the HTTP status as Anthropic's table does."""
        status = self.status
        kind = _ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        message = f"{self.param}: {self.message}" if self.param and self.param not in self.message else self.message
        return {"type": "error", "error": {"type": kind, "message": message}}

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        spec = self.spec
        return {"error": {"message": self.message, "type": spec.type, "param": self.param, "code": spec.code}}


# HTTP status → Anthropic's error type (others: invalid_request_error below 500, api_error above).
_ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
