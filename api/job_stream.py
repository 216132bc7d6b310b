"""Read a chat job's events in order, and notice when its worker, or every worker, is gone.

The stream raises :class:`RelayError` for what the client must hear about (a gap in the
sequence numbers, a worker that died, no worker at all); callers render it once, as an HTTP
error before the response started or as a stream error event after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from arq.constants import result_key_prefix
from redis.exceptions import RedisError

from api.job_takeover import REQUEUED
from api.request_metrics import RequestObserver
from shared.errors import ErrorKind, RelayError
from shared.event_log import read_event_log
from shared.events import AnyEvent, EndEvent, ErrorEvent, StartEvent, decode_event
from shared.jobs import AnyJob
from shared.log_setup import log_transition

if TYPE_CHECKING:
    from api.job_submitter import JobSubmitter

logger = logging.getLogger(__name__)

DisconnectProbe = Callable[[], Awaitable[bool]]


class JobEvents(Protocol):
    """What the response collectors read: a live :class:`JobStream`, or an :class:`EventReplay`."""

    job: AnyJob

    @property
    def job_id(self) -> str: ...

    def events(self) -> AsyncIterator[AnyEvent]: ...

    async def close(self) -> None: ...


class EventReplay:
    """A finished job's events read back from its log, for collecting a background job's or a
    batch line's response with the same code as a live non-stream request."""

    def __init__(self, job: AnyJob, events: list[AnyEvent]) -> None:
        self.job = job
        self._events = events

    @property
    def job_id(self) -> str:
        return self.job.job_id

    async def events(self) -> AsyncIterator[AnyEvent]:
        for event in self._events:
            yield event

    async def close(self) -> None:
        """Nothing to release: the job is over."""


class ClientDisconnected(Exception):
    """The HTTP client went away; the job is cancelled and nothing more is sent."""


class JobStream:
    def __init__(
        self,
        submitter: JobSubmitter,
        job: AnyJob,
        queue: asyncio.Queue[bytes],
        is_disconnected: DisconnectProbe | None,
        observer: RequestObserver,
        backlog: list[AnyEvent] | None = None,
        next_seq: int = 0,
    ) -> None:
        """``backlog``: events read from the job's log before going live (a reconnect), delivered
        first; ``next_seq``: the first event the client still needs."""
        self._submitter = submitter
        self.job = job
        self._queue = queue
        self._is_disconnected = is_disconnected
        self._observer = observer
        self._expected_seq = next_seq
        self._backlog: deque[AnyEvent] = deque(e for e in backlog or [] if e.seq >= next_seq)
        self._silent_since = time.monotonic()
        self.is_finished = False
        self._closed = False

    def stop_disconnect_probe(self) -> None:
        """Once a streaming response has started, sse-starlette owns the disconnect signal."""
        self._is_disconnected = None

    @property
    def job_id(self) -> str:
        return self.job.job_id

    async def next_event(self) -> AnyEvent:
        """The next in-order event; raises RelayError on a gap, a lost worker or no worker."""
        try:
            event = await self._next_in_order()
        except RelayError as error:
            self._observer.failed(error.spec.code or error.kind.value)
            self._log("failed", code=error.spec.code)
            raise
        self._observer.observe(event)
        if isinstance(event, StartEvent):
            self._log("started", worker=event.worker_id, prompt_tokens=event.prompt_tokens)
        elif isinstance(event, EndEvent):
            self._log("finished", completion_tokens=event.usage.completion_tokens)
        elif isinstance(event, ErrorEvent):
            self._log("failed", code=event.kind.value)
        return event

    async def events(self) -> AsyncIterator[AnyEvent]:
        while not self.is_finished:
            yield await self.next_event()

    async def close(self, keep_job: bool = False) -> None:
        """Unsubscribe; a job that did not finish is cancelled so no worker wastes time on it,
        unless it is resumable or ``keep_job`` (this API process is stopping): then it runs on for
        a client that reconnects with Last-Event-ID, here or on another API process."""
        if self._closed:
            return
        self._closed = True
        cancel = not self.is_finished and not self.job.request.resumable and not keep_job
        if cancel:
            self._log("cancelled")
        await self._submitter.release(self, cancel)

    def _log(self, event: str, **fields: object) -> None:
        log_transition(logger, event, self.job_id, self.job.request_id, **fields)

    async def _next_in_order(self) -> AnyEvent:
        while True:
            event = self._backlog.popleft() if self._backlog else await self._next_live()
            if event.seq < self._expected_seq:
                continue  # a duplicate
            if event.seq > self._expected_seq:
                await self._fill_gap(event)
                continue
            self._expected_seq += 1
            self._silent_since = time.monotonic()
            if isinstance(event, EndEvent | ErrorEvent):
                self.is_finished = True
            return event

    async def _next_live(self) -> AnyEvent:
        while True:
            try:
                async with asyncio.timeout(self._submitter.settings.liveness_check_interval_s):
                    return decode_event(await self._queue.get())
            except TimeoutError:
                missed = await self._read_missed()
                if missed:
                    self._backlog.extend(missed[1:])
                    return missed[0]
                await self._check_liveness()

    async def _read_missed(self) -> list[AnyEvent]:
        """While the job is silent: events its log holds that pub/sub did not bring. A gap is
        otherwise noticed only when a later event arrives; a lost last event has none.

        Raises when the job's arq run is over and still no final event was logged: its worker
        returned without finishing the stream (a worker bug), and nothing more will come."""
        redis, keys = self._submitter.redis, self._submitter.keys
        try:
            arq_id = await redis.get(keys.job_arq_id(self.job_id))
            run_is_over = arq_id is not None and await redis.exists(result_key_prefix + arq_id.decode()) > 0
            logged = await read_event_log(redis, keys, self.job_id)
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "lost the connection to Redis") from exc
        missed = [event for event in logged if event.seq >= self._expected_seq]
        if missed:
            logger.info("job %s: %d events missed on pub/sub, read from the log", self.job_id, len(missed))
        elif run_is_over:
            raise RelayError(ErrorKind.INTERNAL, f"job {self.job_id} ended on its worker without a result")
        return missed

    async def _fill_gap(self, arrived: AnyEvent) -> None:
        """Pub/sub is at-most-once: events it dropped are read back from the job's log."""
        logged = await read_event_log(self._submitter.redis, self._submitter.keys, self.job_id)
        missing = [e for e in logged if self._expected_seq <= e.seq < arrived.seq]
        if len(missing) < arrived.seq - self._expected_seq:
            raise RelayError(
                ErrorKind.STREAM_GAP,
                f"events {self._expected_seq}..{arrived.seq - 1} of job {self.job_id} were lost in transit",
            )
        logger.info("job %s: %d events missed on pub/sub, read from the log", self.job_id, len(missing))
        self._backlog.extendleft(reversed([*missing, arrived]))

    async def _check_liveness(self) -> None:
        """While the job is silent: is the client still there, and is the job still being served?"""
        if self._is_disconnected is not None and await self._is_disconnected():
            raise ClientDisconnected()
        submitter, model = self._submitter, self.job.request.model
        try:
            owner = await submitter.redis.get(submitter.keys.job_owner(self.job_id))
            owner_id = owner.decode() if owner else None
            if owner_id is not None and owner_id != REQUEUED:
                if await submitter.directory.is_worker_alive(owner_id):
                    return
                await self._take_over(owner_id)
                return
            if await submitter.directory.has_live_worker(model):
                self._silent_since = time.monotonic()
                return
        except RedisError as exc:
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "lost the connection to Redis") from exc
        if time.monotonic() - self._silent_since >= submitter.settings.no_worker_grace_s:
            raise RelayError(
                ErrorKind.NO_LIVE_WORKER,
                f"No live worker serves model `{model}` any more; the request could not finish.",
                "model",
            )

    async def _take_over(self, dead_worker_id: str) -> None:
        """The job's worker stopped heartbeating: hand the job to another worker, or give up."""
        submitter, model = self._submitter, self.job.request.model
        if not await submitter.directory.has_live_worker(model):
            raise RelayError(
                ErrorKind.WORKER_LOST,
                f"worker {dead_worker_id} stopped responding while serving job {self.job_id}, and no other "
                f"worker serves model `{model}`",
            )
        attempts = int(await submitter.redis.get(submitter.keys.job_attempts(self.job_id)) or 1)
        outcome = await submitter.takeover.requeue(self.job_id, model, dead_worker_id, attempts)
        if outcome < 0:
            raise RelayError(ErrorKind.WORKER_LOST, f"job {self.job_id} lost its worker {attempts} times; giving up")
        if outcome > 0:
            self._log("requeued", dead_worker=dead_worker_id, attempt=attempts + 1)
        self._silent_since = time.monotonic()
