"""Reconnecting to a stream: ``GET /v1/chat/completions/{id}/stream`` (and ``/v1/completions/…``)
with the ``Last-Event-ID`` header (or ``?last_event_id=``) replays the events the client missed
from the job's log, then continues live. Works on any API process, also after the one that took
the request died. Without an id, the whole stream is replayed."""

from __future__ import annotations

from fastapi import APIRouter, Header, Request
from sse_starlette import EventSourceResponse

from api.render.chat_stream import sse_chunks, sse_response
from api.render.completion import sse_completion_chunks
from api.routes.chat import with_errors
from api.services import services_of
from api.tenancy import tenant_of
from shared.contract import ChatJob, CompletionJob
from shared.errors import ErrorKind, RelayError

router = APIRouter()
_STREAM_RESPONSES = with_errors(200, "text/event-stream")


def _last_event_id(header: str | None, query: int | None) -> int | None:
    if header is None:
        return query
    try:
        return int(header)
    except ValueError:
        raise RelayError(ErrorKind.INVALID_REQUEST, "Last-Event-ID must be an event id (an integer).") from None


async def _attach(request: Request, job_id: str, last_event_id: int | None, kind: type) -> EventSourceResponse:
    jobs = services_of(request).jobs
    stream = await jobs.attach(job_id, last_event_id, tenant_of(request))
    if not isinstance(stream.job, kind):
        await stream.close()
        raise RelayError(ErrorKind.NOT_FOUND, f"No {kind.__name__.removesuffix('Job').lower()} job `{job_id}`.")
    settings = jobs.settings
    job = stream.job
    if isinstance(job, ChatJob):
        chunks = sse_chunks(stream, job.delivery.include_usage, settings.reasoning_field, last_event_id is None)
    elif isinstance(job, CompletionJob):
        chunks = sse_completion_chunks(stream, job.delivery.include_usage)
    else:  # an embedding job has no stream to resume
        await stream.close()
        raise RelayError(ErrorKind.NOT_FOUND, f"No streaming job `{job_id}`.")
    return sse_response(chunks, settings)


@router.get(
    "/v1/chat/completions/{job_id}/stream",
    responses=_STREAM_RESPONSES,
    summary="Reconnect to a chat completion stream (Last-Event-ID); extension",
)
async def resume_chat_stream(
    job_id: str,
    request: Request,
    last_event_id_header: str | None = Header(default=None, alias="Last-Event-ID"),
    last_event_id: int | None = None,
) -> EventSourceResponse:
    return await _attach(request, job_id, _last_event_id(last_event_id_header, last_event_id), ChatJob)


@router.get(
    "/v1/completions/{job_id}/stream",
    responses=_STREAM_RESPONSES,
    summary="Reconnect to a text completion stream (Last-Event-ID); extension",
)
async def resume_completion_stream(
    job_id: str,
    request: Request,
    last_event_id_header: str | None = Header(default=None, alias="Last-Event-ID"),
    last_event_id: int | None = None,
) -> EventSourceResponse:
    return await _attach(request, job_id, _last_event_id(last_event_id_header, last_event_id), CompletionJob)
