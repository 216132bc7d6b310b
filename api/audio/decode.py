"""An upload's audio, decoded by PyAV (FFmpeg) to 16 kHz mono: what every Whisper model reads.

The API decodes, not the worker: a file no codec reads, or one longer than the limit, is refused
before any job exists, and workers never parse untrusted containers. The samples are 16-bit,
as nearly all recordings are, which halves what a window holds in Redis."""

from __future__ import annotations

import asyncio
import io

import av
import numpy as np

from shared.errors import ErrorKind, RelayError

SAMPLE_RATE = 16_000


def decode_audio(data: bytes, max_seconds: float) -> np.ndarray:
    """The audio's samples (int16, 16 kHz mono); a 400 naming ``file`` for anything that is not
    audio PyAV can decode, or that lasts longer than ``max_seconds``."""
    max_samples = int(max_seconds * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    num_samples = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise _unreadable("it has no audio stream")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(stream):
                for piece in [*resampler.resample(frame)]:
                    samples = piece.to_ndarray().reshape(-1)
                    num_samples += len(samples)
                    if num_samples > max_samples:
                        raise _too_long(max_seconds)
                    chunks.append(samples)
            for piece in resampler.resample(None):  # what the resampler still holds
                chunks.append(piece.to_ndarray().reshape(-1))
    except RelayError:
        raise
    except (av.FFmpegError, ValueError, IndexError, OSError) as exc:
        raise _unreadable(str(exc) or type(exc).__name__) from None
    samples = np.concatenate(chunks).astype("<i2") if chunks else np.zeros(0, dtype="<i2")
    if len(samples) > max_samples:
        raise _too_long(max_seconds)
    return samples


async def decode_audio_async(data: bytes, max_seconds: float) -> np.ndarray:
    """:func:`decode_audio` on a worker thread: decoding an hour of audio takes seconds."""
    return await asyncio.to_thread(decode_audio, data, max_seconds)


def _unreadable(reason: str) -> RelayError:
    message = f"The file could not be decoded as audio ({reason}). Send a recording in a format FFmpeg reads."
    return RelayError(ErrorKind.INVALID_REQUEST, message, "file")


def _too_long(max_seconds: float) -> RelayError:
    message = f"The audio is longer than this server's limit of {max_seconds:g} seconds (--max-audio-seconds)."
    return RelayError(ErrorKind.INVALID_REQUEST, message, "file")
