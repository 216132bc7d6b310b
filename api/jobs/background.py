"""Submitting a background chat job: one request, no stream, its result polled by id."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from api.jobs.build import make_job
from api.jobs.images import NO_IMAGES, JobImages
from api.jobs.submitter import JobSubmitter, log_unknown_fields
from api.tenancy import tenant_of
from api.wire.openai.chat_request import ChatCompletionRequest
from shared.contract import ChatJob


def job_summary(job: ChatJob, status: str) -> dict[str, Any]:
    """What a background job looks like before it has a result: a ``chat.completion`` with no choices."""
    return {
        "id": job.job_id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "status": status,
        "choices": [],
    }


async def submit_background(
    submitter: JobSubmitter, body: ChatCompletionRequest, request: Request, images: JobImages = NO_IMAGES
) -> dict[str, Any]:
    await submitter.directory.require_worker(body.model)
    request_id = request.state.request_id
    tenant = tenant_of(request).owner
    log_unknown_fields(body, request_id)
    job = make_job(body, request_id, request.state.request_id_is_ours, tenant, images=images)
    assert isinstance(job, ChatJob)
    await submitter.submit_detached(job, track=True, images=images.data)
    return job_summary(job, "queued")
