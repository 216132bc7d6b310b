"""Keep freed tensor memory in the process on CPU engines.

glibc serves every allocation above its mmap threshold (128 KiB at start, raised up to 32 MiB as
large blocks are freed) with a fresh mapping and hands it back to the kernel on free, and it trims
the heap top once enough of it is free. A CPU decode step allocates its logits and activations
anew (a 48-row step over a 49k vocabulary: 9 MiB of logits alone), so each step page-faulted
every one of those pages again, zeroed by the kernel: 987k faults and 3.2 s of system time over
``bench.engine_probe 48 10``, against 130k and 0.8 s with the thresholds fixed high, and ~9 %
more deltas per second (alternating runs). Fixed thresholds also stop glibc adjusting them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc caps the mmap threshold at 32 MiB on 64-bit (HEAP_MAX_SIZE / 2); larger requests are
# model-sized (weights, KV cache) and allocated once, so mapping them is right.
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 1 * 2**30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False (and nothing changed) off glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    applied = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and applied
    if applied:
        mmap_mib, trim_mib = MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20
        logger.debug("malloc thresholds: mmap %d MiB, trim %d MiB", mmap_mib, trim_mib)
    return applied
