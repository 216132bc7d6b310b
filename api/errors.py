"""Every failure leaves the API as an OpenAI error body with the status from the error table; on
the Anthropic Messages routes, as Anthropic's error body with the same status."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import ErrorKind, RelayError

logger = logging.getLogger(__name__)

_HTTP_STATUS_KINDS = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED}


# Busy (429) and unavailable (503) answers say when to come back, also where the raiser did not.
DEFAULT_RETRY_AFTER_S = 2


ANTHROPIC_PATH_PREFIX = "/v1/messages"


def error_response(error: RelayError, path: str = "") -> JSONResponse:
    """``path``: the request's; the Messages API's routes answer in Anthropic's error shape."""
    retry_after_s = error.retry_after_s
    if retry_after_s is None and error.status in (429, 503):
        retry_after_s = DEFAULT_RETRY_AFTER_S
    headers = {"retry-after": str(retry_after_s)} if retry_after_s is not None else None
    body = error.to_anthropic_body() if path.startswith(ANTHROPIC_PATH_PREFIX) else error.to_body()
    return JSONResponse(body, status_code=error.status, headers=headers)


def _param(location: tuple[Any, ...]) -> str | None:
    parts = [str(part) for part in location if part not in ("body", "query", "path")]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> RelayError:
    errors = exc.errors()
    if not errors:
        return RelayError(ErrorKind.INVALID_REQUEST, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return RelayError(ErrorKind.INVALID_REQUEST, f"The request body is not valid JSON: {detail}".rstrip(": "))
    message, param = validation_message(errors)
    return RelayError(ErrorKind.INVALID_REQUEST, message, param)


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """Pydantic errors as one message (the first five) and the first one's parameter path."""
    if not errors:
        return "invalid request", None
    messages = []
    for error in errors[:5]:
        where = _param(tuple(error.get("loc", ())))
        message = str(error.get("msg", "invalid value"))
        messages.append(f"{where}: {message}" if where else message)
    return "; ".join(messages), _param(tuple(errors[0].get("loc", ())))


def translation_error(exc: ValueError, param: str) -> RelayError:
    """A request in another API's format that the chat path cannot take: a 400 naming the field
    (pydantic's path when the chat request's own rules refused it, else ``param``)."""
    if isinstance(exc, ValidationError):
        message, where = validation_message(exc.errors())
        return RelayError(ErrorKind.INVALID_REQUEST, message, where)
    return RelayError(ErrorKind.INVALID_REQUEST, str(exc), param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RelayError)
    async def _relay_error(request: Request, exc: RelayError) -> JSONResponse:
        if exc.kind is ErrorKind.REDIS_UNAVAILABLE and exc.__cause__ is not None:
            # The client hears "try again shortly"; the operator needs what Redis said.
            logger.warning("%s %s: 503, Redis: %r", request.method, request.url.path, exc.__cause__)
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _HTTP_STATUS_KINDS.get(exc.status_code, ErrorKind.INVALID_REQUEST)
        error = RelayError(kind, str(exc.detail))
        response = error_response(error, request.url.path)
        response.status_code = exc.status_code
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(RedisError)
    async def _redis(request: Request, exc: RedisError) -> JSONResponse:
        logger.warning("Redis error while serving a request: %s", exc)
        error = RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly")
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(RelayError(ErrorKind.INTERNAL, "internal server error"), request.url.path)
