"""One stream's decode step compiled ahead of time (AOTInductor), built in a background process
and cached on disk, so a single stream does not pay torch's per-operation cost.

Why: a one-row decode step of the default model is ~1,500 small torch calls; their dispatch and
Python cost, not the arithmetic, is most of the step. Compiled with AOTInductor the step is one
C++ call with fused kernels: 1.3–1.5x faster on a 2-core CPU (`python -m bench.decode_step_probe --compiled`).

Why this shape:
- **Ahead of time, in another process.** Compiling takes ~40 s of two cores for the default
  model; in the worker's own process its Python work held the GIL and slowed the serving engine
  ~12x while it ran. A child process (`python -m worker.models.compile_decode`, at lower CPU
  priority) loads the same model, exports the step and writes a package; the worker serves
  eagerly meanwhile and switches once the package is loaded.
- **Cached** under ``--cache-dir``, keyed by what the kernels depend on: the weights (a digest),
  the KV cache's shape, the dtype, torch's version and the thread count (OpenMP's team size is
  compiled into the kernels). The next start loads it in about a second.
- **Bounded**: the build gets ``BUILD_TIMEOUT_S``; a failure or a timeout is logged and the
  worker stays eager.
- **Only where it is the same step**: one row in slot 0 with no shared prefix, a thread count
  equal to the package's, and fewer keys than ``max_model_len`` (the export's dynamic range).
  Anything else, a batch included, runs the eager forward.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.native.decoder import NativeCausalLM
from worker.native.fingerprint import update_with_weights
from worker.native.kv_cache import SlotKVCache

logger = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 900.0
# inductor's own settings: casts kept where eager rounds (logits then agree with the eager step
# to bf16 rounding), weights folded in as constants.
_INDUCTOR_CONFIGS = {"emulate_precision_casts": True, "freezing": True}


class CompileState(StrEnum):
    OFF = "off"
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"


class _OneRowCache:
    """The step cache of one row in slot 0 at ``position``, reading its first ``length`` keys."""

    shared_groups = ()

    def __init__(self, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...], length: Any,
                 position: torch.Tensor) -> None:  # fmt: skip
        self.keys, self.values, self.length, self.position = keys, values, length, position

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[0].index_copy_(1, self.position, key[0])
        values[0].index_copy_(1, self.position, value[0])
        return keys[0:1, :, : self.length], values[0:1, :, : self.length]

    def shared_kv(self, layer_idx: int, group: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("a one-row step reads no shared prefix")


class OneRowStep(nn.Module):
    """What the compiled package computes: ``ModelRunner.decode`` for one row in slot 0.

    ``length_marker``'s size is the number of keys read (position + 1): the export's one dynamic
    dimension. ``kv`` is every layer's keys, then every layer's values (the slot cache's tensors)."""

    def __init__(self, model: NativeCausalLM) -> None:
        super().__init__()
        self.model = model
        self.num_layers = model.config.num_hidden_layers

    def forward(self, token: torch.Tensor, position: torch.Tensor, length_marker: torch.Tensor,
                *kv: torch.Tensor) -> torch.Tensor:  # fmt: skip
        cache = _OneRowCache(kv[: self.num_layers], kv[self.num_layers :], length_marker.shape[0], position.view(1))
        hidden = self.model.hidden_states(token, position, None, cache)  # type: ignore[arg-type]
        return self.model.logits(hidden[:, 0]).float()


def step_inputs(kv: tuple[torch.Tensor, ...], token_id: int, position: int) -> tuple[torch.Tensor, ...]:
    """The package's inputs; ``kv`` is ``kv_inputs(cache)``, the same tensors at every step."""
    return (torch.tensor([[token_id]]), torch.tensor([[position]]), torch.empty(position + 1, dtype=torch.uint8), *kv)


def kv_inputs(cache: SlotKVCache) -> tuple[torch.Tensor, ...]:
    return (*cache.keys, *cache.values)


def build_package(model: NativeCausalLM, cache: SlotKVCache, path: Path) -> None:
    """Export the one-row step against ``cache``'s shapes and compile it into ``path``."""
    length = torch.export.Dim("length", min=2, max=cache.max_model_len - 1)
    dynamic = (None, None, {0: length}, tuple(None for _ in range(2 * len(cache.keys))))
    with torch.inference_mode():
        exported = torch.export.export(OneRowStep(model), step_inputs(kv_inputs(cache), 0, 1), dynamic_shapes=dynamic,
                                       strict=False)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    torch._inductor.aoti_compile_and_package(exported, package_path=str(partial), inductor_configs=_INDUCTOR_CONFIGS)
    partial.replace(path)  # whole or not at all: a killed build leaves no package behind


def can_compile() -> bool:
    """AOTInductor needs a C++ compiler on PATH."""
    return any(shutil.which(name) for name in ("c++", "g++", "clang++"))


def package_key(model: NativeCausalLM, cache: SlotKVCache, num_threads: int) -> str:
    """What the compiled kernels depend on: the weights (``update_with_weights``), the KV cache's
    shape, the dtype, torch's version and the thread count."""
    digest = hashlib.blake2b(digest_size=12)
    update_with_weights(digest, model)
    shape = "x".join(str(size) for size in cache.keys[0].shape)
    digest.update(f"{shape}:{cache.layout.dtype}:{torch.__version__}:{num_threads}".encode())
    return f"decode1-{digest.hexdigest()}-t{num_threads}"


class CompiledDecode:
    """The compiled one-row step of one worker: built or loaded in the background, used once ready.

    ``start`` is called once the engine is built; the engine thread then asks ``runs`` before each
    one-row step and calls ``__call__`` when it says yes."""

    def __init__(self, model: NativeCausalLM, cache: SlotKVCache, cache_dir: Path, build_args: list[str]) -> None:
        """``build_args``: the ``python -m worker.models.compile_decode`` arguments that load the
        same model (``--model ... --dtype ...``); the package path and thread count are added."""
        self._model = model
        self._cache = cache
        self._kv = kv_inputs(cache)  # the slot cache's tensors never change: built once, not per step
        self._dir = cache_dir / "compiled"
        self._build_args = build_args
        self.state = CompileState.OFF
        self.num_threads = 0
        self.seconds = 0.0  # how long building or loading took
        self.path: Path | None = None
        self.num_steps = 0  # steps it ran
        self._runner: Any = None
        self._thread: threading.Thread | None = None

    def start(self, num_threads: int) -> None:
        """Load the cached package, or build it first, on a background thread (and process)."""
        self.num_threads = num_threads
        self.state = CompileState.BUILDING
        self._thread = threading.Thread(target=self._prepare, name="relaylm-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> CompileState:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.state

    def runs(self, num_rows: int, kv_len: int) -> bool:
        """Whether this step is the compiled one (engine thread)."""
        return (
            self.state is CompileState.READY
            and num_rows == 1
            and 2 <= kv_len < self._cache.max_model_len
            and torch.get_num_threads() == self.num_threads
        )

    def __call__(self, token_id: int, position: int) -> torch.Tensor:
        """fp32 logits ``[1, vocab]`` of the row in slot 0, writing its key and value at ``position``."""
        self.num_steps += 1
        return self._runner(*step_inputs(self._kv, token_id, position))

    def _prepare(self) -> None:
        began = time.monotonic()
        try:
            self.path = path = self._dir / f"{package_key(self._model, self._cache, self.num_threads)}.pt2"
            built = not path.exists()
            if built:
                logger.info("compiling the one-row decode step in the background (eager until ready): %s", path)
                self._build(path)
            self._runner = torch._inductor.aoti_load_package(str(path))
        except Exception as exc:  # the worker serves eagerly whatever went wrong here
            self.state = CompileState.FAILED
            logger.warning("the one-row decode step was not compiled (eager from now on): %s", exc)
            return
        self.seconds = time.monotonic() - began
        self.state = CompileState.READY
        how = "compiled and cached" if built else "loaded from the cache"
        logger.info("one-row decode step %s in %.1f s (%d threads): %s", how, self.seconds, self.num_threads, path)

    def _build(self, path: Path) -> None:
        command = [sys.executable, "-m", "worker.models.compile_decode", *self._build_args, "--out", str(path),
                   "--num-threads", str(self.num_threads), "--parent-pid", str(os.getpid())]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if result.returncode != 0 or not path.exists():
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"the build exited with code {result.returncode}: {' | '.join(tail)}")
