"""One thread owns every torch call: it loads the model, builds the engine and runs its loop.

Why: with the OpenMP build of torch, once one thread has run parallel regions, torch work on
any other thread ran ~2.5x slower on our 2-core CPU (its worker team keeps spinning). Loading
on a helper thread and decoding on another cost 40% of batch-1 decode speed.

So torch's thread count is set here too: ``set_num_threads`` may be called from any thread,
and the engine thread applies it before loading and then between steps (OpenMP's thread count
is per calling thread, so setting it anywhere else would not reach the engine).

If the loop itself dies (its own failure handling failed), ``exited`` says so: a worker whose
engine is gone must stop heartbeating, or APIs would wait on its jobs for ever.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from worker.kinds.base import Engine

logger = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, build: Callable[[], Engine[Any]], num_threads: int | None = None) -> None:
        """``build``: loads the model and builds its engine (a worker kind's ``start``)."""
        self._build = build
        self._num_threads_wanted = num_threads  # written by any thread
        self._num_threads_applied: int | None = None  # engine thread only
        self._ready: Future[Engine[Any]] = Future()
        self._exited: Future[None] = Future()
        self._thread = threading.Thread(target=self._main, name="relaylm-engine", daemon=True)

    async def start(self) -> Engine[Any]:
        """Load and build on the engine thread; resolves once the loop is about to run."""
        self._thread.start()
        return await asyncio.wrap_future(self._ready)

    async def exited(self) -> None:
        """Returns when the engine loop has returned (after ``stop``); raises what killed it."""
        await asyncio.wrap_future(self._exited)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def set_num_threads(self, num_threads: int) -> None:
        """Any thread: torch's thread count for the engine, applied before the load or the next step."""
        self._num_threads_wanted = num_threads

    def _apply_num_threads(self) -> None:
        # The caller writes only "wanted" and this thread only "applied", so no lock and no lost wish.
        wanted = self._num_threads_wanted
        if wanted is not None and wanted != self._num_threads_applied:
            torch.set_num_threads(wanted)
            self._num_threads_applied = wanted

    def _main(self) -> None:
        try:
            self._apply_num_threads()
            engine = self._build()
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        engine.before_step = self._apply_num_threads
        self._ready.set_result(engine)
        try:
            engine.run_forever()
        except BaseException as exc:
            logger.critical("the engine loop died", exc_info=True)
            self._exited.set_exception(exc)
        else:
            self._exited.set_result(None)
