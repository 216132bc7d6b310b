"""Cutting a recording into windows: at most the window length each, contiguous, covering the audio exactly,
cut at the quietest 100 ms of each window's last third, and the same cut for the same samples."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from api.audio.windows import FRAME_S, MAX_WINDOW_S, SAMPLE_RATE, cut_windows

WINDOW_S = 30.0

# A low rate keeps hypothesis' recordings small while every window still spans many frames.
RATE = 200
MAX_LEN = int(WINDOW_S * RATE)
FRAME = int(FRAME_S * RATE)


@st.composite
def recordings(draw: st.DrawFn) -> np.ndarray:
    num_samples = draw(st.integers(min_value=0, max_value=8 * MAX_LEN))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    loudness = draw(st.sampled_from([0, 1, 100, 30_000]))
    samples = np.random.default_rng(seed).integers(-loudness, loudness + 1, num_samples)
    return samples.astype(np.int16)


@settings(max_examples=200, deadline=None)
@given(recordings())
def test_windows_cover_the_audio_contiguously_and_fit_the_window(samples: np.ndarray) -> None:
    windows = cut_windows(samples, WINDOW_S, rate=RATE)
    assert windows[0][0] == 0
    assert windows[-1][1] == len(samples)
    for (_, end), (start, _) in itertools.pairwise(windows):
        assert end == start
    for start, end in windows:
        assert 0 < end - start <= MAX_LEN or len(samples) == 0


@settings(max_examples=200, deadline=None)
@given(recordings())
def test_every_cut_but_the_last_falls_in_the_last_third(samples: np.ndarray) -> None:
    for start, end in cut_windows(samples, WINDOW_S, rate=RATE)[:-1]:
        assert start + (2 * MAX_LEN) // 3 <= end <= start + MAX_LEN


@settings(max_examples=100, deadline=None)
@given(recordings())
def test_the_same_samples_give_the_same_windows(samples: np.ndarray) -> None:
    assert cut_windows(samples, WINDOW_S, rate=RATE) == cut_windows(samples.copy(), WINDOW_S, rate=RATE)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=MAX_LEN))
def test_audio_up_to_the_window_length_is_one_window(num_samples: int) -> None:
    assert cut_windows(np.ones(num_samples, dtype=np.int16), WINDOW_S, rate=RATE) == [(0, num_samples)]


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=(2 * MAX_LEN) // 3, max_value=MAX_LEN - FRAME), st.integers(min_value=0, max_value=2**16))
def test_the_cut_is_in_the_silence(silence_at: int, seed: int) -> None:
    """Loud noise with one silent 100 ms frame (frame-aligned) in the last third: the cut lands in it."""
    silence_at -= (silence_at - (2 * MAX_LEN) // 3) % FRAME
    noise = np.random.default_rng(seed).integers(1000, 30_000, 2 * MAX_LEN).astype(np.int16)
    noise[silence_at : silence_at + FRAME] = 0
    (_, end), *_ = cut_windows(noise, WINDOW_S, rate=RATE)
    assert silence_at <= end <= silence_at + FRAME


def test_an_hour_at_16_khz_cuts_into_windows_in_the_last_third_of_the_default_length() -> None:
    samples = np.random.default_rng(0).integers(-3000, 3000, 3600 * SAMPLE_RATE).astype(np.int16)
    windows = cut_windows(samples)
    lengths = [end - start for start, end in windows]
    shortest, longest = 2 * MAX_WINDOW_S / 3, MAX_WINDOW_S
    assert all(shortest * SAMPLE_RATE <= length <= longest * SAMPLE_RATE for length in lengths[:-1])
    assert sum(lengths) == len(samples)
