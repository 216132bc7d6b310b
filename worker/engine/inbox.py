"""The loop of an engine that runs whole units of work in turn (an embedding micro-batch, a
transcription window), as opposed to the token-step loop of :class:`LLMEngine`.

Work is submitted from any thread and run on the loop's thread. Every submitted unit ends with
an output marked done, also when it was aborted or failed: the job runner waits for that, and so
does the client's stream. A unit that fails ends its job with an error; the loop goes on."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from shared.errors import ErrorKind
from worker.engine.engine import RequestOutput

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how often an idle loop looks at its stop flag and thread count


class Unit(Protocol):
    @property
    def request_id(self) -> str: ...


U = TypeVar("U", bound=Unit)
Abort = tuple[ErrorKind | None, str]


class InboxEngine(Generic[U]):
    """Subclasses say how units are gathered into one run (``_gather``), run (``_run``) and
    ended early (``_end``)."""

    failure_message = "the work failed inside the worker"

    def __init__(self, sink: Callable[[list[RequestOutput]], None], max_running: int) -> None:
        self._sink = sink
        self._inbox: queue.Queue[U] = queue.Queue()
        self._lock = threading.Lock()
        self._live: dict[str, list[U]] = {}  # units submitted and not yet ended, per request id
        self._aborted: dict[int, Abort] = {}  # by id() of a live unit
        self._stopping = threading.Event()
        self._num_running = 0
        self.max_running = max_running
        self.before_step: Callable[[], None] | None = None  # run on the loop's thread before each run

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, work: U) -> None:
        with self._lock:
            self._live.setdefault(work.request_id, []).append(work)
        self._inbox.put(work)

    def abort(self, request_id: str, kind: ErrorKind | None = None, message: str = "") -> None:
        """Stop the units submitted before this call (before they run, or at their next
        chance); with ``kind`` the stream ends with that error, without it silently. Units that
        already ended are left alone, and so are units submitted later under the same id."""
        with self._lock:
            for work in self._live.get(request_id, []):
                self._aborted[id(work)] = (kind, message)

    def load(self) -> tuple[int, int, float, float]:
        """Running and waiting units; these engines keep no prefix or KV cache."""
        return self._num_running, self._inbox.qsize(), 0.0, 0.0

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize()

    def stop(self) -> None:
        self._stopping.set()

    # -- the loop's thread ----------------------------------------------------------------------
    def run_forever(self) -> None:
        while not self._stopping.is_set():
            if self.before_step is not None:
                self.before_step()
            try:
                first = self._inbox.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                continue
            works = self._gather(first)
            self._num_running = len(works)
            live: list[U] = []
            try:
                for work in works:
                    abort = self.aborted(work)
                    if abort is None:
                        live.append(work)
                    else:
                        self._end(work, *abort)
                if live:
                    self._run(live)
            except Exception:
                logger.exception("%s: %d units failed", type(self).__name__, len(live))
                for work in live:
                    self._end(work, ErrorKind.INTERNAL, self.failure_message)
            finally:
                with self._lock:
                    for work in works:
                        others = [unit for unit in self._live.pop(work.request_id, []) if unit is not work]
                        if others:
                            self._live[work.request_id] = others
                        self._aborted.pop(id(work), None)
                self._num_running = 0

    def aborted(self, work: U) -> Abort | None:
        """Why a running unit should stop now, if it should."""
        with self._lock:
            return self._aborted.get(id(work))

    def _gather(self, first: U) -> list[U]:
        """The units of one run (by default the first alone)."""
        return [first]

    def _run(self, works: list[U]) -> None:
        raise NotImplementedError

    def _end(self, work: U, kind: ErrorKind | None, message: str) -> None:
        """The last output of a unit that will not finish: its error, or nothing (cancelled)."""
        raise NotImplementedError
