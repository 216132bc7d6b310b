"""The OpenAI error body, ``{"error": {"message", "type", "param", "code"}}``, for the OpenAPI schema."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorObject
