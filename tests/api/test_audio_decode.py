"""Decoding uploads: any container and codec FFmpeg reads becomes 16 kHz mono int16; what is not
audio, or is longer than the limit, is a 400 naming ``file``; silence and empty audio are audio."""

from __future__ import annotations

import asyncio
import io
import wave

import av
import numpy as np
import pytest

from api.audio.decode import SAMPLE_RATE, decode_audio, decode_audio_async
from shared.errors import RelayError


def _tone(seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * 32767 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)


def _wav(samples: np.ndarray, rate: int, num_channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(num_channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.repeat(samples, num_channels).astype("<i2").tobytes())
    return buffer.getvalue()


def _encoded(samples: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """``samples`` (mono int16) encoded by PyAV, as a phone or browser would upload them."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=rate)
        assert isinstance(stream, av.AudioStream)
        stream.layout = "mono"
        frame_size = 1152
        for begin in range(0, len(samples), frame_size):
            frame = av.AudioFrame.from_ndarray(samples[None, begin : begin + frame_size], format="s16", layout="mono")
            frame.sample_rate = rate
            frame.pts = begin
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode(None):
            output.mux(packet)
    return buffer.getvalue()


def test_a_stereo_8_khz_wav_becomes_16_khz_mono() -> None:
    samples = decode_audio(_wav(_tone(2.0, 8000), 8000, num_channels=2), max_seconds=60)
    assert samples.dtype == np.dtype("<i2")
    assert abs(len(samples) - 2 * SAMPLE_RATE) <= 64
    assert np.abs(samples).max() > 10_000  # the tone survived resampling


def test_a_16_khz_wav_keeps_its_samples() -> None:
    tone = _tone(1.0, SAMPLE_RATE)
    samples = decode_audio(_wav(tone, SAMPLE_RATE), max_seconds=60)
    assert len(samples) == len(tone)
    assert np.abs(samples.astype(np.int32) - tone).max() <= 1


@pytest.mark.parametrize(("container", "codec"), [("mp3", "libmp3lame"), ("ogg", "opus"), ("flac", "flac")])
def test_compressed_uploads_decode(container: str, codec: str) -> None:
    rate = 48_000 if codec == "opus" else 44_100
    samples = decode_audio(_encoded(_tone(1.5, rate), rate, container, codec), max_seconds=60)
    assert abs(len(samples) - 1.5 * SAMPLE_RATE) <= 0.1 * SAMPLE_RATE
    assert np.abs(samples).max() > 5_000


def test_silence_and_empty_audio_are_not_errors() -> None:
    assert not decode_audio(_wav(np.zeros(SAMPLE_RATE, dtype=np.int16), SAMPLE_RATE), max_seconds=60).any()
    assert len(decode_audio(_wav(np.zeros(0, dtype=np.int16), SAMPLE_RATE), max_seconds=60)) == 0


@pytest.mark.parametrize("data", [b"this is not audio at all", b"RIFF\x00\x00\x00\x00WAVEfmt ", b"\x00" * 4096])
def test_what_is_not_audio_is_a_400_naming_file(data: bytes) -> None:
    with pytest.raises(RelayError) as caught:
        decode_audio(data, max_seconds=60)
    assert (caught.value.status, caught.value.param) == (400, "file")


def test_longer_than_the_limit_is_a_400_naming_file() -> None:
    with pytest.raises(RelayError, match="max-audio-seconds") as caught:
        decode_audio(_wav(_tone(3.0, SAMPLE_RATE), SAMPLE_RATE), max_seconds=2)
    assert (caught.value.status, caught.value.param) == (400, "file")


def test_decoding_runs_off_the_event_loop() -> None:
    async def decode_while_ticking() -> tuple[np.ndarray, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        samples = await decode_audio_async(_wav(_tone(120.0, 44_100), 44_100), max_seconds=600)
        ticker.cancel()
        return samples, ticks

    samples, ticks = asyncio.run(decode_while_ticking())
    assert len(samples) == 120 * SAMPLE_RATE
    assert ticks > 1
