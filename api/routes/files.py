"""``/v1/files``: upload, list, read and delete files (batch input, batch output and errors, and
images that requests name by file id)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from api.batches.file_store import FileStore
from api.routes.chat import ERROR_RESPONSES, with_errors
from api.services import services_of
from api.tenancy import tenant_of
from api.wire.openai.batch import FileDeleted, FileList, FileObject
from shared.errors import ErrorKind, RelayError

router = APIRouter()


def _store(request: Request) -> FileStore:
    return services_of(request).files


@router.post("/v1/files", response_model=FileObject, responses=ERROR_RESPONSES, summary="Upload a file")
async def upload_file(
    request: Request,
    file: Annotated[UploadFile, File(description="A JSONL file (batch), or an image (vision).")],
    purpose: Annotated[str, Form(description="`batch` or `vision`.")],
) -> FileObject:
    if purpose not in ("batch", "vision"):
        raise RelayError(ErrorKind.INVALID_REQUEST, "Only purposes `batch` and `vision` are supported.", "purpose")
    content = await file.read()
    if not content:
        raise RelayError(ErrorKind.INVALID_REQUEST, "The file is empty.", "file")
    owner = tenant_of(request).owner
    if purpose == "vision":  # checked by decoding when a request names it, as every image is
        return await _store(request).create(content, file.filename or "image", "vision", owner=owner)
    _require_utf8(content)
    return await _store(request).create(content, file.filename or "upload.jsonl", "batch", owner=owner)


def _require_utf8(content: bytes) -> None:
    """A batch input file is JSONL, so UTF-8 text: other bytes are refused here, naming the line,
    rather than failing the batch later. (Lone surrogates in JSON escapes are valid UTF-8; batch
    validation names the line and field that holds one.)"""
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = content.count(b"\n", 0, exc.start) + 1
        message = f"The file is not valid UTF-8 (line {line}, byte {exc.start}); a batch input file is JSONL text."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "file") from None


@router.get("/v1/files", response_model=FileList, responses=ERROR_RESPONSES, summary="List files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = Query(default=10_000, ge=1, le=10_000),
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> FileList:
    files, has_more = await _store(request).list(
        purpose, limit, after, newest_first=order == "desc", tenant=tenant_of(request)
    )
    return FileList(
        data=files,
        first_id=files[0].id if files else None,
        last_id=files[-1].id if files else None,
        has_more=has_more,
    )


@router.get(
    "/v1/files/{file_id}", response_model=FileObject, responses=ERROR_RESPONSES, summary="Get a file's metadata"
)
async def get_file(request: Request, file_id: str) -> FileObject:
    return (await _store(request).get(file_id, tenant_of(request))).public()


@router.get(
    "/v1/files/{file_id}/content",
    responses=with_errors(200, "application/octet-stream"),
    summary="Download a file's content",
)
async def get_file_content(request: Request, file_id: str) -> Response:
    store = _store(request)
    meta = await store.get(file_id, tenant_of(request))
    content = await store.content(file_id, tenant_of(request))
    media_type = "application/jsonl" if meta.filename.endswith(".jsonl") else "application/octet-stream"
    return Response(content, media_type=media_type)


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=ERROR_RESPONSES, summary="Delete a file")
async def delete_file(request: Request, file_id: str) -> FileDeleted:
    await _store(request).delete(file_id, tenant_of(request))
    return FileDeleted(id=file_id)
