"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: Whisper through the queue.

The upload is decoded here (PyAV) and cut at its quiet moments into windows of at most --audio-window-s
(:mod:`api.audio.windows`); each window is one job (:mod:`api.audio.recording`), so every
worker of the model takes windows of one long recording at once, and the answer stitches them
in order.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from api.audio.decode import decode_audio_async
from api.audio.form import AudioRequest, audio_request, read_form
from api.audio.recording import Recording
from api.jobs.client import JobClient
from api.jobs.stream import ClientDisconnected
from api.render.chat_stream import sse_response
from api.render.transcript import Transcript
from api.routes.chat import ERROR_RESPONSES, OpenApiResponses
from api.routes.start import CLIENT_CLOSED_REQUEST
from api.services import services_of
from api.wire.openai.audio import RESPONSE_FORMATS, TIMESTAMP_GRANULARITIES
from shared.errors import ErrorKind, RelayError

router = APIRouter()

_AUDIO_RESPONSES: OpenApiResponses = {
    200: {"content": {"application/json": {}, "text/plain": {}, "text/event-stream": {}}},
    **ERROR_RESPONSES,
}
_MULTIPART_FORM = {
    "requestBody": {
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "model"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "model": {"type": "string"},
                        "language": {"type": "string"},
                        "prompt": {"type": "string"},
                        "response_format": {"type": "string", "enum": list(RESPONSE_FORMATS)},
                        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
                        "timestamp_granularities[]": {
                            "type": "array",
                            "items": {"enum": list(TIMESTAMP_GRANULARITIES)},
                        },
                        "stream": {"type": "boolean"},
                    },
                }
            }
        },
        "required": True,
    }
}


@router.post(
    "/v1/audio/transcriptions",
    responses=_AUDIO_RESPONSES,
    openapi_extra=_MULTIPART_FORM,
    summary="Transcribe audio (OpenAI-compatible; multipart; SSE when stream=true)",
)
async def create_transcription(request: Request) -> Response:
    return await _serve(request, translate=False)


@router.post(
    "/v1/audio/translations",
    responses=_AUDIO_RESPONSES,
    openapi_extra=_MULTIPART_FORM,
    summary="Translate audio into English text (OpenAI-compatible; multipart)",
)
async def create_translation(request: Request) -> Response:
    return await _serve(request, translate=True)


async def _serve(request: Request, translate: bool) -> Response:
    jobs = services_of(request).jobs
    settings = jobs.settings
    form = await read_form(request)
    try:
        body = await audio_request(form, translate, settings.max_audio_bytes)
    finally:
        await form.close()
    arrived_at = time.monotonic()
    await _require_transcription_model(jobs, body)
    samples = await decode_audio_async(body.audio, settings.max_audio_seconds)
    run = Recording(jobs, body, samples, arrived_at)
    await run.submit(request)
    try:
        is_client_here = await run.wait_for_start(settings.sse_ping_interval_s if body.stream else None)
    except BaseException:
        await run.close()
        raise
    if not is_client_here:
        await run.close()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if body.stream:
        for stream in run.streams:
            stream.stop_disconnect_probe()
        return sse_response(run.sse(), settings)
    try:
        transcript = await run.collect()
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await run.close()
    return render(transcript, body.response_format, body.words)


def render(transcript: Transcript, response_format: str, with_words: bool) -> Response:
    """The answer in ``response_format``; OpenAI serves text, SRT and WebVTT all as text/plain."""
    if response_format == "text":
        return PlainTextResponse(transcript.as_text())
    if response_format == "srt":
        return PlainTextResponse(transcript.as_srt())
    if response_format == "vtt":
        return PlainTextResponse(transcript.as_vtt())
    if response_format == "verbose_json":
        return JSONResponse(transcript.as_verbose(with_words).model_dump(exclude_none=True))
    return JSONResponse(transcript.as_json().model_dump(exclude_none=True))


async def _require_transcription_model(jobs: JobClient, body: AudioRequest) -> None:
    """A live worker serves the model (404/503 otherwise), it transcribes, and it can do what is asked."""
    model = body.model
    await jobs.directory.require_worker(model)
    workers = await jobs.directory.workers(model)
    tasks = {worker.task for worker in workers}
    if tasks and "transcribe" not in tasks:
        serves = "embeddings" if tasks == {"embed"} else "chat and text completions"
        message = f"Model `{model}` serves {serves}, not audio transcription."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "model")
    # A loading worker has not said what its model knows yet; the worker that claims the job refuses the same.
    ready = [worker for worker in workers if worker.task == "transcribe" and worker.state == "ready"]
    if ready and all(worker.english_only for worker in ready):
        _refuse_beyond_english(body)


def _refuse_beyond_english(body: AudioRequest) -> None:
    """An English-only model neither translates nor takes another language: refused here, before
    any job exists (its workers refuse the same, for records that do not say)."""
    if body.translate:
        message = f"Model `{body.model}` is English-only; it cannot translate."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "model")
    if body.language not in (None, "en"):
        message = f"Model `{body.model}` is English-only; the language must be `en`, not `{body.language}`."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "language")
