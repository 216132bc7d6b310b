"""``/v1/batches``: create, poll, cancel and list batches (OpenAI's Batch API)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Query, Request

from api.batches.store import BatchStore, StoredBatch
from api.routes.chat import ERROR_RESPONSES
from api.services import services_of
from api.tenancy import tenant_of
from api.wire.openai.batch import TERMINAL_STATUSES, Batch, BatchList, CreateBatchRequest
from shared.errors import ErrorKind, RelayError

router = APIRouter()

_WINDOW_S = {"24h": 24 * 3600}
_CANCEL_LOCK_WAIT_S = 10.0


def _store(request: Request) -> BatchStore:
    return services_of(request).batches


@router.post("/v1/batches", response_model=Batch, responses=ERROR_RESPONSES, summary="Create a batch")
async def create_batch(body: CreateBatchRequest, request: Request) -> Batch:
    files = services_of(request).files
    tenant = tenant_of(request)
    input_file = await files.get(body.input_file_id, tenant)
    if input_file.purpose != "batch":
        message = f"File `{body.input_file_id}` has purpose `{input_file.purpose}`, not `batch`."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "input_file_id")
    await _check_line_limit(request, input_file.num_lines, tenant.owner)
    now = int(time.time())
    batch = StoredBatch(
        id=f"batch_{uuid.uuid4().hex}",
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + _WINDOW_S[body.completion_window],
        metadata=body.metadata,
        owner=tenant.owner,
        owner_weight=tenant.weight,
        owner_ranks_across_tenants=tenant.ranks_across_tenants,
        num_lines=input_file.num_lines,
    )
    # Validation and the rest happen in the batch runner of whichever API process gets there first.
    await _store(request).create(batch)
    return batch.public()


async def _check_line_limit(request: Request, num_lines: int, owner: str | None) -> None:
    """429 when the key's unfinished batches and this one would queue more lines than its limit."""
    settings = services_of(request).settings
    limit = settings.max_batch_lines_per_key
    if limit == 0 or owner is None:
        return
    left = await _store(request).lines_left(owner)
    if left + num_lines > limit:
        raise RelayError(
            ErrorKind.KEY_LIMIT_REACHED,
            f"This API key's unfinished batches have {left} lines to run; {num_lines} more would pass its limit "
            f"of {limit} batch lines. Retry when some have finished.",
            retry_after_s=settings.retry_after_s,
        )


@router.get("/v1/batches/{batch_id}", response_model=Batch, responses=ERROR_RESPONSES, summary="Get a batch")
async def get_batch(request: Request, batch_id: str) -> Batch:
    return (await _store(request).get(batch_id, tenant_of(request))).public()


@router.post("/v1/batches/{batch_id}/cancel", response_model=Batch, responses=ERROR_RESPONSES, summary="Cancel a batch")
async def cancel_batch(request: Request, batch_id: str) -> Batch:
    store = _store(request)
    async with store.locked(batch_id, wait_s=_CANCEL_LOCK_WAIT_S) as held:
        if not held:
            raise RelayError(ErrorKind.INTERNAL, f"Batch `{batch_id}` is busy; retry the cancel.")
        batch = await store.get(batch_id, tenant_of(request))
        if batch.status in TERMINAL_STATUSES or batch.status == "cancelling":
            if batch.status != "cancelling" and batch.status != "cancelled":
                message = f"Batch `{batch_id}` is already {batch.status}; it cannot be cancelled."
                raise RelayError(ErrorKind.CONFLICT, message)
            return batch.public()
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        await store.save(batch)
    return batch.public()


@router.get("/v1/batches", response_model=BatchList, responses=ERROR_RESPONSES, summary="List batches")
async def list_batches(
    request: Request, limit: int = Query(default=20, ge=1, le=100), after: str | None = None
) -> BatchList:
    batches, has_more = await _store(request).list(limit, after, tenant_of(request))
    return BatchList(
        data=batches,
        first_id=batches[0].id if batches else None,
        last_id=batches[-1].id if batches else None,
        has_more=has_more,
    )
