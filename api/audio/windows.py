"""Cut a recording into transcription windows at its quietest moments.

Each window (at most ``max_window_s``; Whisper itself reads 30 s at a time within it) ends at
the quietest 100 ms (lowest energy) of the last third of its span, so a cut falls between words,
not through one; the last window ends with the audio. Windows are contiguous and cover the
recording exactly, and the cut depends on the samples alone, so the same file always gives the
same windows (and so the same text, however many workers share them)."""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16_000
MAX_WINDOW_S = 120.0
FRAME_S = 0.1


def cut_windows(
    samples: np.ndarray, max_window_s: float = MAX_WINDOW_S, rate: int = SAMPLE_RATE
) -> list[tuple[int, int]]:
    """``(start, end)`` sample offsets of each window; one empty window for empty audio."""
    max_len = max(1, int(max_window_s * rate))
    frame = max(1, int(FRAME_S * rate))
    windows: list[tuple[int, int]] = []
    start, total = 0, len(samples)
    while total - start > max_len:
        search_from = start + (2 * max_len) // 3
        # A cut at the window's own start (possible only for windows shorter than 3 samples) would never advance.
        end = max(start + 1, _quietest_frame_end(samples, search_from, start + max_len, frame))
        windows.append((start, end))
        start = end
    windows.append((start, total))
    return windows


def _quietest_frame_end(samples: np.ndarray, begin: int, end: int, frame: int) -> int:
    """Where to cut within ``[begin, end]``: the middle of the ``frame``-long stretch with the
    least energy (the first such stretch on a tie)."""
    span = samples[begin:end].astype(np.float64)
    num_frames = len(span) // frame
    if num_frames == 0:
        return end
    energy = (span[: num_frames * frame].reshape(num_frames, frame) ** 2).sum(axis=1)
    quietest = int(np.argmin(energy))
    return begin + quietest * frame + frame // 2
