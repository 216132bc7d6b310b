"""One thread owns every torch call: it loads the model, builds the engine and runs its loop.

Why: with the OpenMP build of torch, once one thread has run parallel regions, torch work on
any other thread ran ~2.5x slower on our 2-core CPU (its worker team keeps spinning). Loading
on a helper thread and decoding on another cost 40% of batch-1 decode speed.

If the loop itself dies (its own failure handling failed), ``exited`` says so: a worker whose
engine is gone must stop heartbeating, or APIs would wait on its jobs for ever.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from worker.engine.engine import LLMEngine
from worker.model_loader import LoadedModel

logger = logging.getLogger(__name__)

EngineFactory = Callable[[LoadedModel], LLMEngine]


class EngineThread:
    def __init__(self, load: Callable[[], LoadedModel], build: EngineFactory) -> None:
        self._load = load
        self._build = build
        self._ready: Future[tuple[LoadedModel, LLMEngine]] = Future()
        self._exited: Future[None] = Future()
        self._thread = threading.Thread(target=self._main, name="relaylm-engine", daemon=True)

    async def start(self) -> tuple[LoadedModel, LLMEngine]:
        """Load and build on the engine thread; resolves once the loop is about to run."""
        self._thread.start()
        return await asyncio.wrap_future(self._ready)

    async def exited(self) -> None:
        """Returns when the engine loop has returned (after ``stop``); raises what killed it."""
        await asyncio.wrap_future(self._exited)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def _main(self) -> None:
        try:
            loaded = self._load()
            engine = self._build(loaded)
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result((loaded, engine))
        try:
            engine.run_forever()
        except BaseException as exc:
            logger.critical("the engine loop died", exc_info=True)
            self._exited.set_exception(exc)
        else:
            self._exited.set_result(None)
