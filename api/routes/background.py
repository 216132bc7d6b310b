"""Background chat jobs (extension, modelled on OpenAI's background mode and stored completions):
``POST /v1/chat/completions`` with ``"background": true`` answers at once; the job is polled
with ``GET /v1/chat/completions/{id}``, cancelled with ``POST .../{id}/cancel`` and its stored
result removed with ``DELETE .../{id}``."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.routing import APIRouter

from api.jobs.background import job_summary
from api.jobs.background_results import BackgroundResults
from api.jobs.detached import DetachedJobs
from api.routes.chat import ERROR_RESPONSES
from api.services import services_of
from api.tenancy import Tenant, tenant_of
from shared.contract import ChatJob, decode_job
from shared.errors import ErrorKind, RelayError
from shared.job_lifecycle import JobLifecycle

router = APIRouter()


def _not_found(job_id: str) -> RelayError:
    return RelayError(ErrorKind.NOT_FOUND, f"No background chat completion `{job_id}` (or it expired).")


async def _background_job(lifecycle: JobLifecycle, job_id: str, tenant: Tenant) -> ChatJob:
    """The job, if it is a background job the tenant may see; another key's is a 404."""
    payload = await lifecycle.payload(job_id)
    job = decode_job(payload) if payload is not None else None
    if not isinstance(job, ChatJob) or not job.delivery.background or not tenant.can_see(job.tenant):
        raise _not_found(job_id)
    return job


async def _stored_result(request: Request, job_id: str) -> dict[str, Any] | None:
    """The kept result of an ended background job, if the asking key may see it (404 if not)."""
    state = services_of(request)
    raw = await state.redis.get(state.settings.keys.job_result(job_id))
    if raw is None:
        return None
    record: dict[str, Any] = json.loads(raw)
    if not tenant_of(request).can_see(record.get("tenant")):
        raise _not_found(job_id)
    return record


def _from_record(job_id: str, record: dict[str, Any], job: ChatJob | None) -> dict[str, Any]:
    body = record.get("body") or {}
    if record["status"] == "completed":
        return {**body, "status": "completed"}
    summary = {**record.get("summary", {}), **(job_summary(job, record["status"]) if job else {})}
    summary.update(id=job_id, status=record["status"])
    if record["status"] == "failed":
        summary["error"] = body.get("error")
    return summary


@router.get("/v1/chat/completions/{job_id}", responses=ERROR_RESPONSES, summary="Poll a background chat completion")
async def get_background(request: Request, job_id: str) -> dict[str, Any]:
    state = services_of(request)
    stored = await _stored_result(request, job_id)
    if stored is not None:
        return _from_record(job_id, stored, None)
    job = await _background_job(state.lifecycle, job_id, tenant_of(request))
    jobs: DetachedJobs = state.detached_jobs
    current = (await jobs.states([job_id]))[job_id]
    if current.outcome is None:
        return job_summary(job, current.status)
    results: BackgroundResults = state.background_results
    status = "completed" if current.outcome.succeeded else "failed"
    await results.store(job_id, status, current.outcome, job_summary(job, status), job.tenant)
    stored = await _stored_result(request, job_id)
    return job_summary(job, status) if stored is None else _from_record(job_id, stored, job)


@router.post(
    "/v1/chat/completions/{job_id}/cancel",
    responses=ERROR_RESPONSES,
    summary="Cancel a background chat completion",
)
async def cancel_background(request: Request, job_id: str) -> dict[str, Any]:
    state = services_of(request)
    stored = await _stored_result(request, job_id)
    if stored is not None:
        return _from_record(job_id, stored, None)  # already over: nothing to cancel
    job = await _background_job(state.lifecycle, job_id, tenant_of(request))
    await state.lifecycle.cancel([job_id])
    results: BackgroundResults = state.background_results
    await results.store(job_id, "cancelled", None, job_summary(job, "cancelled"), job.tenant)
    return job_summary(job, "cancelled")


@router.delete(
    "/v1/chat/completions/{job_id}", responses=ERROR_RESPONSES, summary="Delete a background chat completion"
)
async def delete_background(request: Request, job_id: str) -> dict[str, Any]:
    state = services_of(request)
    redis, keys = state.redis, state.settings.keys
    if await _stored_result(request, job_id) is None:
        await _background_job(state.lifecycle, job_id, tenant_of(request))  # 404 unless it exists
        raise RelayError(ErrorKind.CONFLICT, f"Chat completion `{job_id}` is still running; cancel it first.")
    # The request and event log go too, so the job is gone for good (not collected again).
    await redis.delete(keys.job_result(job_id))
    await state.lifecycle.delete(job_id)
    return {"id": job_id, "object": "chat.completion.deleted", "deleted": True}
