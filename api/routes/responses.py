"""``/v1/responses``: the OpenAI Responses API, on the same jobs as chat completions.

The request (with the conversation of ``previous_response_id``) becomes a chat request and runs
as a chat job; ``store: true`` (the default) keeps the response for ``GET``, ``input_items`` and a
later ``previous_response_id``. A background response is a durable job like a background chat
completion: it survives API and worker restarts, is polled with ``GET``, cancelled with
``POST …/cancel``, and its stream is replayed with ``GET …?stream=true&starting_after=N``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import TypeAdapter

from api.errors import translation_error
from api.jobs.images import JobImages
from api.jobs.results import EndedJob
from api.render.chat_stream import sse_response
from api.render.responses import ResponseBuilder, collect_response, response_events, response_id
from api.response_store import StoredResponse
from api.routes.chat import ERROR_RESPONSES, streaming_post, with_errors
from api.routes.start import CLIENT_CLOSED_REQUEST, chat_job, start_stream
from api.services import services_of
from api.tenancy import Tenant, tenant_of
from api.wire.openai.chat_request import ChatCompletionRequest
from api.wire.responses import InputItem, ResponsesRequest, image_sources, to_chat_request
from shared.contract import ChatJob
from shared.errors import ErrorKind, RelayError
from shared.job_lifecycle import JobState

router = APIRouter()
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def _chat_request(body: ResponsesRequest, history: list[InputItem]) -> ChatCompletionRequest:
    """400 (naming the field) for what the chat path cannot take."""
    try:
        return to_chat_request(body, history)
    except ValueError as exc:
        raise translation_error(exc, "input") from None


def _input_dicts(body: ResponsesRequest, response_id: str) -> list[dict[str, Any]]:
    items = [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in body.input_items()]
    return [{"id": f"item_{response_id}_{i}", **item} if "id" not in item else item for i, item in enumerate(items)]


def _finished(stored: StoredResponse, final: dict[str, Any]) -> StoredResponse:
    """The stored record of an ended response: its output joins the conversation."""
    conversation = [*(stored.earlier or []), *stored.input_items, *final["output"]]
    # A background response keeps its job: its stream can be replayed while the job's log lives.
    return StoredResponse(
        final, stored.input_items, conversation, stored.owner, stored.request, stored.earlier, stored.job_id
    )


@streaming_post(router, "/v1/responses", "Create a model response (OpenAI Responses API; SSE when stream=true)")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    services = services_of(request)
    tenant = tenant_of(request)
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id:
        earlier = (await services.responses.get(body.previous_response_id, tenant, "previous_response_id")).conversation
    history = _ITEMS.validate_python(earlier)
    chat = _chat_request(body, history)
    if body.background:
        if not body.store:
            raise RelayError(ErrorKind.INVALID_REQUEST, "background responses must be stored (store=true)", "store")
        # Resumable: a client that stops reading the stream leaves the job running.
        chat = chat.model_copy(update={"resumable": True, "stream": False, "stream_options": None})
    job, images = await chat_job(request, chat, image_sources(body, history))
    # A chain of responses is one conversation: this one is placed where the one it continues ran.
    chain = [response_id(job.job_id)] if body.store else []
    if body.previous_response_id:
        chain.insert(0, body.previous_response_id)
    job = job.model_copy(update={"affinity": (*job.affinity, *(f"response:{name}" for name in chain))})
    if body.background:
        return await _start_background(request, body, job, earlier, images)
    stream = await start_stream(request, job, images)
    if stream is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    builder = ResponseBuilder(body, stream.job_id, input_tokens=stream.prompt_tokens or 0)
    pending = StoredResponse(builder.response("in_progress"), _input_dicts(body, builder.id), [], tenant.owner,
                             earlier=earlier)  # fmt: skip

    async def keep(final: dict[str, Any]) -> None:
        if body.store:
            await services.responses.save(_finished(pending, final))

    if body.stream:
        return sse_response(response_events(stream, builder, keep), services.settings)
    final = await collect_response(stream, builder)
    await keep(final)
    return final


async def _start_background(
    request: Request, body: ResponsesRequest, job: ChatJob, earlier: list[dict[str, Any]], images: JobImages
) -> Any:
    """Store the queued response, then start its job detached (its result is kept once it ends);
    with ``stream`` the client also follows its events (and may leave and replay them later)."""
    services = services_of(request)
    tenant = tenant_of(request)
    builder = ResponseBuilder(body, job.job_id)
    queued = builder.response("queued")
    stored = StoredResponse(
        queued, _input_dicts(body, builder.id), [], tenant.owner,
        request=body.model_dump(mode="json", by_alias=True), earlier=earlier, job_id=job.job_id,
    )  # fmt: skip
    await services.responses.save(stored)
    try:
        await services.jobs.detach(job, images.data)
    except BaseException:
        await services.responses.delete(builder.id, tenant)  # never a response that no job will finish
        raise
    if body.stream:
        return await _stream_background(request, stored, tenant, starting_after=-1)
    return queued


async def _current(request: Request, stored: StoredResponse) -> StoredResponse:
    """A background response as its job stands now; once the job ended, its final form is stored."""
    if stored.is_final or stored.job_id is None or stored.request is None:
        return stored
    services = services_of(request)
    ended = await services.results.keep(stored.job_id)
    if ended is None:
        record = await services.lifecycle.record(stored.job_id)
        status = "in_progress" if record is not None and record.state is JobState.RUNNING else "queued"
        return StoredResponse({**stored.response, "status": status}, stored.input_items, [], stored.owner,
                              stored.request, stored.earlier, stored.job_id)  # fmt: skip
    body = ResponsesRequest.model_validate(stored.request)
    builder = ResponseBuilder(body, stored.job_id, created_at=stored.response["created_at"])
    done = _finished(stored, await _rendered(ended, builder))
    await services.responses.save(done)
    return done


async def _rendered(ended: EndedJob, builder: ResponseBuilder) -> dict[str, Any]:
    """The final Response of an ended job, from its kept events (the code a live request uses)."""
    if ended.job is None:
        return builder.response("failed", RelayError(ErrorKind.EXPIRED, "The response's job is gone (it expired)."))
    if ended.state is JobState.CANCELLED:
        return builder.response("cancelled")
    try:
        return await collect_response(ended.replay(), builder)
    except RelayError as error:
        return builder.response("failed", error)


async def _stream_background(request: Request, stored: StoredResponse, tenant: Tenant, starting_after: int) -> Any:
    """The response's events from the start (the SDK needs ``response.created`` first), without
    those up to ``starting_after``; live until it ends."""
    jobs = services_of(request).jobs
    assert stored.job_id is not None and stored.request is not None
    body = ResponsesRequest.model_validate(stored.request)
    stream = await jobs.attach(stored.job_id, None, tenant)
    builder = ResponseBuilder(body, stored.job_id, created_at=stored.response["created_at"])

    async def keep(final: dict[str, Any]) -> None:
        await services_of(request).responses.save(_finished(stored, final))

    async def after(events: AsyncIterator[dict[str, str]]) -> AsyncIterator[dict[str, str]]:
        async for event in events:
            if int(event["id"]) > starting_after:
                yield event

    return sse_response(after(response_events(stream, builder, keep, with_ids=True)), jobs.settings)


@router.get("/v1/responses/{response_id}", responses=with_errors(200, "text/event-stream"), summary="Get a response")
async def get_response(
    request: Request, response_id: str, stream: bool = False, starting_after: int = Query(default=-1, ge=-1)
) -> Any:
    tenant = tenant_of(request)
    stored = await services_of(request).responses.get(response_id, tenant)
    if stream:
        if stored.job_id is None:
            message = "Only a background response can be streamed again; this one was answered at once."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "stream")
        return await _stream_background(request, stored, tenant, starting_after)
    return (await _current(request, stored)).response


@router.post("/v1/responses/{response_id}/cancel", responses=ERROR_RESPONSES, summary="Cancel a background response")
async def cancel_response(request: Request, response_id: str) -> dict[str, Any]:
    """Idempotent: an ended response is returned as it is."""
    stored = await _current(request, await services_of(request).responses.get(response_id, tenant_of(request)))
    if stored.is_final:
        return stored.response
    if stored.job_id is None:
        raise RelayError(ErrorKind.INVALID_REQUEST, "Only a background response can be cancelled.", "response_id")
    await services_of(request).results.cancel(stored.job_id)
    return (await _current(request, stored)).response


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES, summary="Delete a stored response")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    await services_of(request).responses.delete(response_id, tenant_of(request))
    return {"id": response_id, "object": "response", "deleted": True}


@router.get(
    "/v1/responses/{response_id}/input_items", responses=ERROR_RESPONSES, summary="List a stored response's input items"
)
async def list_input_items(
    request: Request,
    response_id: str,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    items = (await services_of(request).responses.get(response_id, tenant_of(request))).input_items
    ordered = items if order == "asc" else list(reversed(items))
    ids = [item["id"] for item in ordered]
    if after is not None:
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit,
    }  # fmt: skip
