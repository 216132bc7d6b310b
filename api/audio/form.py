"""An audio request's multipart form, read into one checked :class:`AudioRequest` by OpenAI's
rules: `file` and `model` required; `timestamp_granularities[]` only with `verbose_json`;
`stream` only for transcriptions, in `json` or `text`; translations take file, model, prompt,
response_format and temperature only. Other fields (``include[]``, ``chunking_strategy``) are
not Whisper's and are ignored."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from starlette.datastructures import FormData, UploadFile

from api.wire.openai.audio import RESPONSE_FORMATS, STREAM_FORMATS, TIMESTAMP_GRANULARITIES
from shared.errors import ErrorKind, RelayError


@dataclass(frozen=True)
class AudioRequest:
    model: str
    audio: bytes
    translate: bool
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float
    words: bool
    stream: bool


async def read_form(request: Request) -> FormData:
    try:
        return await request.form(max_files=1, max_fields=32)
    except Exception as exc:  # starlette's MultiPartException and friends: a malformed body
        message = f"The request must be multipart/form-data with a `file` and a `model` ({exc})."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "file") from None


def _text_field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RelayError(ErrorKind.INVALID_REQUEST, f"`{name}` must be a text field.", name)
    return value


async def audio_request(form: FormData, translate: bool, max_audio_bytes: int) -> AudioRequest:
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise RelayError(ErrorKind.INVALID_REQUEST, "`file` is required: the audio file to transcribe.", "file")
    model = _text_field(form, "model")
    if not model:
        raise RelayError(ErrorKind.INVALID_REQUEST, "`model` is required.", "model")
    response_format = _text_field(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        message = f"`response_format` must be one of {', '.join(RESPONSE_FORMATS)}; got `{response_format}`."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "response_format")
    stream = _flag(_text_field(form, "stream"), "stream")
    if translate:
        _refuse_transcription_fields(form, stream)
    granularities = [g for key in ("timestamp_granularities[]", "timestamp_granularities") for g in form.getlist(key)]
    for granularity in granularities:
        if granularity not in TIMESTAMP_GRANULARITIES:
            message = f"`timestamp_granularities` takes `word` and `segment`; got `{granularity}`."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "timestamp_granularities")
    if granularities and response_format != "verbose_json":
        message = "`response_format` must be `verbose_json` to use `timestamp_granularities`."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "timestamp_granularities")
    if stream and response_format not in STREAM_FORMATS:
        message = f"`stream` answers text deltas; `response_format` `{response_format}` does not stream."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "stream")
    language = _text_field(form, "language") or None
    audio = await upload.read(max_audio_bytes + 1)
    if len(audio) > max_audio_bytes:
        raise RelayError(
            ErrorKind.PAYLOAD_TOO_LARGE, f"The file exceeds this server's limit of {max_audio_bytes} bytes.", "file"
        )
    if not audio:
        raise RelayError(ErrorKind.INVALID_REQUEST, "The file is empty.", "file")
    return AudioRequest(
        model=model, audio=audio, translate=translate, language=language, prompt=_text_field(form, "prompt") or None,
        response_format=response_format, temperature=_temperature(_text_field(form, "temperature")),
        words="word" in granularities, stream=stream,
    )  # fmt: skip


def _refuse_transcription_fields(form: FormData, stream: bool) -> None:
    """OpenAI's translations take file, model, prompt, response_format and temperature only."""
    for name in ("language", "timestamp_granularities[]", "timestamp_granularities", *(["stream"] if stream else [])):
        if name in form:
            param = name.removesuffix("[]")
            message = f"Translations take no `{param}` (the output is English text, not streamed)."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, param)


def _flag(value: str | None, name: str) -> bool:
    if value is None or value.lower() in ("false", "0", ""):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise RelayError(ErrorKind.INVALID_REQUEST, f"`{name}` must be true or false; got `{value}`.", name)


def _temperature(value: str | None) -> float:
    if value is None or value == "":
        return 0.0
    try:
        temperature = float(value)
    except ValueError:
        temperature = -1.0
    if not 0.0 <= temperature <= 1.0:
        message = f"`temperature` must be between 0 and 1; got `{value}`."
        raise RelayError(ErrorKind.INVALID_REQUEST, message, "temperature")
    return temperature
