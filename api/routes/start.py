"""How a route turns its request into a job and starts it: the one recipe that chat completions,
the Messages API and the Responses API (each translated into a chat request first), text
completions and embeddings share. Limits are checked and images loaded before the job exists;
the job starts through the services' :class:`~api.jobs.client.JobClient`, which checks for a
live worker once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from fastapi import Request, Response

from api.jobs.build import SubmittableRequest, make_job
from api.jobs.client import log_unknown_fields
from api.jobs.images import NO_IMAGES, JobImages
from api.jobs.stream import ClientDisconnected, JobStream
from api.render.chat_stream import sse_response
from api.services import services_of
from api.settings import ApiSettings
from api.tenancy import tenant_of
from api.wire.openai.chat_request import ChatCompletionRequest
from api.wire.openai.images import ImageSource
from shared.contract import AnyJob, ChatJob
from shared.errors import ErrorKind, RelayError
from shared.events import ErrorEvent

CLIENT_CLOSED_REQUEST = 499
Answer = TypeVar("Answer")


def check_request_limits(body: ChatCompletionRequest, settings: ApiSettings) -> None:
    if len(body.messages) > settings.max_messages:
        message = f"At most {settings.max_messages} messages are allowed."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "messages")
    if body.tools and len(body.tools) > settings.max_tools:
        raise RelayError(ErrorKind.INVALID_REQUEST, f"At most {settings.max_tools} tools are allowed.", "tools")


async def chat_job(
    request: Request, chat: ChatCompletionRequest, image_sources: Sequence[ImageSource]
) -> tuple[ChatJob, JobImages]:
    """The chat request's job, within this server's limits, with its images (``image_sources``:
    the wire request's image parts, named as its API names them) loaded."""
    services = services_of(request)
    check_request_limits(chat, services.settings)
    images = await services.images.load(tenant_of(request), chat.model, image_sources)
    job = job_of(request, chat, images)
    assert isinstance(job, ChatJob)
    return job, images


def job_of(request: Request, body: SubmittableRequest, images: JobImages = NO_IMAGES) -> AnyJob:
    """The job of one HTTP request, owned by the asking key, with the request's id."""
    state = request.state
    log_unknown_fields(body, state.request_id)
    return make_job(body, state.request_id, state.request_id_is_ours, tenant_of(request), images=images)


async def start_stream(request: Request, job: AnyJob, images: JobImages = NO_IMAGES) -> JobStream | None:
    """Start the job, then wait for the worker's first word before answering: a rejection
    (context too long, bad template input) can still be a proper HTTP error instead of a 200
    stream. A stream whose job is still queued after one keep-alive period starts anyway, so
    that keep-alive comments flow while it waits (proxies cut silent connections); a rejection
    then arrives as an error event. None: the client left while waiting."""
    jobs = services_of(request).jobs
    stream = await jobs.stream(job, request.is_disconnected, images=images.data)
    streamed = job.delivery.stream
    wait_s = jobs.settings.sse_ping_interval_s if streamed else None
    try:
        first = await stream.first_event(wait_s)
    except ClientDisconnected:
        await stream.close()
        return None
    except BaseException:
        await stream.close()
        raise
    if isinstance(first, ErrorEvent):
        await stream.close()
        raise first.to_exception()
    if streamed:
        stream.stop_disconnect_probe()  # sse-starlette owns the connection from here
    return stream


async def answer(
    request: Request,
    job: AnyJob,
    collect: Callable[[JobStream], Awaitable[Answer]],
    sse: Callable[[JobStream], AsyncIterator[dict[str, str]]] | None = None,
    images: JobImages = NO_IMAGES,
) -> Answer | Response:
    """Start the job and answer with its events: as server-sent events (``sse``) when the client
    asked for a stream, else the response ``collect`` builds; a 499 once the client left."""
    stream = await start_stream(request, job, images)
    if stream is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if sse is not None and job.delivery.stream:
        return sse_response(sse(stream), services_of(request).settings)
    try:
        return await collect(stream)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
