"""Files and Batch API objects (OpenAI's ``FileObject``, ``Batch`` and the JSONL line formats)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
TERMINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
FilePurpose = Literal["batch", "batch_output", "vision"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None

    @field_validator("endpoint")
    @classmethod
    def _served_endpoint(cls, value: str) -> str:
        if value not in BATCH_ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("metadata holds at most 16 keys, each up to 64 characters, values up to 512")
        return value


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    created_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expires_at: int
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class BatchInputLine(BaseModel):
    """One line of an input file: ``{"custom_id", "method": "POST", "url", "body"}``."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class BatchResponseData(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchOutputLine(BaseModel):
    """One line of the output file (``response``) or of the error file (``error``)."""

    id: str
    custom_id: str
    response: BatchResponseData | None = None
    error: dict[str, Any] | None = None
