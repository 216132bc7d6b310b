"""The build process of one stream's compiled decode step (``worker.native.compiled_decode``):
started by the worker at lower CPU priority, it loads the same model as the worker does, builds
the package and exits. It lives with model loading because it loads a model; the step itself is
native code."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
from pathlib import Path

import torch

from worker.models.loader import load_model
from worker.native.compiled_decode import build_package
from worker.native.decoder import NativeCausalLM
from worker.native.kv_cache import KVCacheLayout, SlotKVCache

_PR_SET_PDEATHSIG = 1
_BUILD_NICENESS = 10


def yield_to(parent_pid: int) -> None:
    """First thing in the build process: serving goes first and the build takes what is left; on
    Linux it is killed with its worker (a SIGKILLed worker leaves no build running). Done here, not
    in a ``preexec_fn``, which is unsafe in the worker's threaded process."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the worker died before the line above took effect
        raise SystemExit("the worker that asked for this build is gone")
    os.nice(_BUILD_NICENESS)


def _main() -> None:
    """The build process: load the model as the worker does, build the package, exit."""
    parser = argparse.ArgumentParser(description="Build the one-row decode package (run by the worker).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--model-impl", default="native")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--num-cache-slots", type=int, required=True, help="all slots of the KV cache")
    parser.add_argument("--num-threads", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parent-pid", type=int, required=True, help="the worker's: the build dies with it")
    args = parser.parse_args()
    yield_to(args.parent_pid)
    torch.set_num_threads(args.num_threads)
    loaded = load_model(args.model, args.cache_dir, args.device, args.dtype, args.max_model_len, args.model_impl,
                        args.quantization)  # fmt: skip
    model = loaded.model
    assert isinstance(model, NativeCausalLM)
    layout = KVCacheLayout.from_config(model.config, model.dtype, model.device)
    twin = SlotKVCache(layout, args.num_cache_slots - 1, loaded.max_model_len)  # the same shapes, lazily backed
    build_package(model, twin, args.out)


if __name__ == "__main__":
    _main()
