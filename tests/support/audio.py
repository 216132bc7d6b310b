"""Real speech for the audio tests: Debian's pocketsphinx-testdata LibriVox clips (public domain
readings of *Sense and Sensibility*, with their transcripts), recordings built from them, speech
synthesised by espeak-ng, and the word error rate."""

from __future__ import annotations

import re
import shutil
import subprocess
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LIBRIVOX_DIR = Path("/usr/share/pocketsphinx/test/data/librivox")
SAMPLE_RATE = 16_000

# Spoken forms Whisper writes otherwise; the transcripts spell words out.
_SPELLED = {"mr": "mister", "mrs": "missus", "dr": "doctor"}


@dataclass(frozen=True)
class Clip:
    name: str
    path: Path
    transcript: str


def librivox_clips() -> list[Clip]:
    """The clips and their reference transcripts (``<s> words </s> (name)`` per line)."""
    clips = []
    for line in (LIBRIVOX_DIR / "transcription").read_text().splitlines():
        match = re.fullmatch(r"<s>(.*)</s>\s*\((.+)\)", line.strip())
        if match:
            words, name = match.group(1).strip(), match.group(2)
            clips.append(Clip(name, LIBRIVOX_DIR / f"{name}.wav", words))
    return clips


def missing_test_data() -> str | None:
    """Why the speech tests cannot run here, or None."""
    if not (LIBRIVOX_DIR / "transcription").is_file():
        return f"no LibriVox clips at {LIBRIVOX_DIR} (Debian package pocketsphinx-testdata; `make test` installs it)"
    if shutil.which("espeak-ng") is None:
        return "no espeak-ng on PATH (Debian package espeak-ng; `make test` installs it)"
    return None


def normalize(text: str) -> list[str]:
    """Lower case, words only: hyphens and punctuation are spaces, titles spelled out."""
    words = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()
    return [_SPELLED.get(word, word) for word in (w.strip("'") for w in words) if word]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference words), by word-level edit distance."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, ref_word in enumerate(ref, start=1):
        previous, row[0] = row[0], i
        for j, hyp_word in enumerate(hyp, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ref_word != hyp_word))
    return row[-1], len(ref)


def read_wav(path: Path) -> np.ndarray:
    """A 16 kHz mono 16-bit WAV's samples."""
    with wave.open(str(path)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (SAMPLE_RATE, 1, 2), path
        return np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")


def write_wav(path: Path, samples: np.ndarray, rate: int = SAMPLE_RATE) -> Path:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(samples.astype("<i2").tobytes())
    return path


def long_recording(path: Path, repeats: int = 3, gap_s: float = 0.8) -> tuple[Path, str]:
    """Every clip in order, ``gap_s`` of silence between them, ``repeats`` times (about 27 s a
    round): a recording several transcription windows long. Returns it and its transcript."""
    clips = librivox_clips()
    gap = np.zeros(int(gap_s * SAMPLE_RATE), dtype="<i2")
    parts: list[np.ndarray] = []
    for _ in range(repeats):
        for clip in clips:
            parts += [read_wav(clip.path), gap]
    transcript = " ".join([clip.transcript for clip in clips] * repeats)
    return write_wav(path, np.concatenate(parts)), transcript


def silence(path: Path, seconds: float) -> Path:
    return write_wav(path, np.zeros(int(seconds * SAMPLE_RATE), dtype="<i2"))


def espeak(path: Path, text: str, voice: str) -> Path:
    """``text`` spoken by espeak-ng in ``voice`` (e.g. ``es``), as a WAV file (22,050 Hz)."""
    subprocess.run(["espeak-ng", "-v", voice, "-s", "140", "-w", str(path), text], check=True, capture_output=True)
    return path
