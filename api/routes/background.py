"""Background chat jobs (extension, modelled on OpenAI's background mode and stored completions):
``POST /v1/chat/completions`` with ``"background": true`` answers at once; the job is polled
with ``GET /v1/chat/completions/{id}``, cancelled with ``POST .../{id}/cancel`` and its stored
result removed with ``DELETE .../{id}``.

While it runs, a poll answers a ``chat.completion`` with no choices and its ``status``; once it
ended, the completion a non-stream request would have received (``status: completed``), or the
summary with the error (``failed``) or without (``cancelled``), rendered from the result store
(:mod:`api.jobs.results`)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.routing import APIRouter

from api.jobs.detached import render_outcome
from api.jobs.results import EndedJob
from api.render.background import background_summary
from api.routes.chat import ERROR_RESPONSES
from api.services import services_of
from api.tenancy import tenant_of
from shared.contract import AnyJob, ChatJob, decode_job
from shared.errors import ErrorKind, RelayError
from shared.job_lifecycle import JobState

router = APIRouter()


def _not_found(job_id: str) -> RelayError:
    return RelayError(ErrorKind.NOT_FOUND, f"No background chat completion `{job_id}` (or it expired).")


async def _ended_or_job(request: Request, job_id: str) -> EndedJob | ChatJob:
    """The job's kept result once it has ended (kept now if it just did), else the job; a 404
    for one that is not a background chat completion, or is another key's."""
    services = services_of(request)
    tenant = tenant_of(request)
    ended = await services.results.get(job_id)
    if ended is None:
        stored = await services.lifecycle.stored(job_id)
        job = decode_job(stored.payload, stored.delivery) if stored is not None else None
        if not _is_background_chat(job) or not tenant.can_see(job.tenant if job else None):
            raise _not_found(job_id)
        ended = await services.results.keep(job_id)
        if ended is None:
            assert isinstance(job, ChatJob)
            return job
    if (ended.job is not None and not _is_background_chat(ended.job)) or not tenant.can_see(ended.tenant):
        raise _not_found(job_id)
    return ended


def _is_background_chat(job: AnyJob | None) -> bool:
    """A background Response runs as a chat job too, but is reached only through its response id."""
    return isinstance(job, ChatJob) and job.delivery.background


async def _render(ended: EndedJob, reasoning_field: str) -> dict[str, Any]:
    if ended.job is None:
        gone = RelayError(ErrorKind.EXPIRED, f"Job `{ended.job_id}` is gone from Redis (it expired, or Redis lost it).")
        summary = {"id": ended.job_id, "object": "chat.completion", "status": "failed", "choices": []}
        return {**summary, "error": gone.to_body()["error"]}
    if ended.state is JobState.CANCELLED:
        return background_summary(ended.job, "cancelled")
    outcome = await render_outcome(ended.job, ended.replay(), reasoning_field)
    if outcome.succeeded:
        return {**outcome.body, "status": "completed"}
    return {**background_summary(ended.job, "failed"), "error": outcome.body.get("error")}


@router.get("/v1/chat/completions/{job_id}", responses=ERROR_RESPONSES, summary="Poll a background chat completion")
async def get_background(request: Request, job_id: str) -> dict[str, Any]:
    found = await _ended_or_job(request, job_id)
    if isinstance(found, EndedJob):
        return await _render(found, services_of(request).settings.reasoning_field)
    record = await services_of(request).lifecycle.record(job_id)
    running = record is not None and record.state is JobState.RUNNING
    return background_summary(found, "in_progress" if running else "queued")


@router.post(
    "/v1/chat/completions/{job_id}/cancel",
    responses=ERROR_RESPONSES,
    summary="Cancel a background chat completion",
)
async def cancel_background(request: Request, job_id: str) -> dict[str, Any]:
    """Idempotent: an ended job is answered as it ended."""
    found = await _ended_or_job(request, job_id)
    ended = found if isinstance(found, EndedJob) else await services_of(request).results.cancel(job_id)
    return await _render(ended, services_of(request).settings.reasoning_field)


@router.delete(
    "/v1/chat/completions/{job_id}", responses=ERROR_RESPONSES, summary="Delete a background chat completion"
)
async def delete_background(request: Request, job_id: str) -> dict[str, Any]:
    if not isinstance(await _ended_or_job(request, job_id), EndedJob):
        raise RelayError(ErrorKind.CONFLICT, f"Chat completion `{job_id}` is still running; cancel it first.")
    await services_of(request).results.delete(job_id)
    return {"id": job_id, "object": "chat.completion.deleted", "deleted": True}
