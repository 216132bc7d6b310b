"""Read a job's events in order, and keep the job moving while it is silent.

Events arrive on the job's pub/sub channel; the job's log fills whatever pub/sub dropped, and
:class:`~api.jobs.event_cursor.EventCursor` hands them out in order, each once. While the job is
silent the stream looks at the job's record once per ``liveness_check_interval_s``: events the
log has and the channel lost are read back; a job no worker serves is settled by the orphan rule
the housekeeper applies too (:mod:`api.jobs.orphans`), and when that ends the job its final
event arrives like any other. When the event router subscribed again after a break (a Redis
failover), the stream reads the log from its cursor on before it takes live events again; under
Sentinel or Cluster it rides out Redis not answering while a failover may still name a new
primary (:mod:`api.jobs.redis_outage`).

The stream raises :class:`RelayError` only for what it alone can see (unreadable bytes on the
channel, a gap the log cannot fill, the job's record gone, Redis not answering past the wait);
callers render it once, as an HTTP error before the response started or as a stream error event
after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from pydantic import ValidationError
from redis.exceptions import RedisError

from api.jobs.event_cursor import EventCursor
from api.jobs.event_router import ChannelItem, EventRouter, SubscriptionRenewed
from api.jobs.orphans import Orphans
from api.jobs.redis_outage import RedisOutage
from api.jobs.worker_directory import WorkerDirectory
from api.request_metrics import RequestObserver
from api.settings import ApiSettings
from shared.contract import AnyJob
from shared.errors import ErrorKind, RelayError
from shared.events import AnyEvent, EndEvent, ErrorEvent, StartEvent, decode_event
from shared.job_lifecycle import JobLifecycle
from shared.log_setup import log_transition

logger = logging.getLogger(__name__)

DisconnectProbe = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class StreamServices:
    """What a stream needs from its API process."""

    lifecycle: JobLifecycle
    router: EventRouter
    directory: WorkerDirectory
    settings: ApiSettings


class ClientDisconnected(Exception):
    """The HTTP client went away; the job is cancelled and nothing more is sent."""


def redis_unavailable(exc: RedisError) -> RelayError:
    return RelayError(ErrorKind.REDIS_UNAVAILABLE, f"lost the connection to Redis ({exc})")


class JobStream:
    def __init__(
        self,
        services: StreamServices,
        job: AnyJob,
        queue: asyncio.Queue[ChannelItem],
        is_disconnected: DisconnectProbe | None,
        observer: RequestObserver,
        backlog: list[AnyEvent] | None = None,
        next_seq: int = 0,
        is_finished: bool = False,
    ) -> None:
        """``backlog``: events read from the job's log before going live (a reconnect), delivered
        first; ``next_seq``: the first event the client still needs; ``is_finished``: the client
        already has every event of an ended job."""
        self._services = services
        self.job = job
        self._queue = queue
        self._is_disconnected = is_disconnected
        self._observer = observer
        self._cursor = EventCursor(next_seq)
        self._cursor.take(backlog or [])
        settings = services.settings
        self._orphans = Orphans(services.lifecycle, services.directory, settings.no_worker_grace_s)
        self._outage = RedisOutage(settings.redis_failover_wait_s if settings.redis_target.is_replicated else 0.0)
        self.is_finished = is_finished
        self._closed = False
        # The first event, still awaited when a stream started before its job did (see first_event).
        self._pending_first: asyncio.Task[AnyEvent] | None = None
        self.prompt_tokens: int | None = None  # from the start event, once seen

    def stop_disconnect_probe(self) -> None:
        """Once a streaming response has started, sse-starlette owns the disconnect signal."""
        self._is_disconnected = None

    @property
    def job_id(self) -> str:
        return self.job.job_id

    async def first_event(self, timeout_s: float | None) -> AnyEvent | None:
        """The first event, or None when ``timeout_s`` passes first (the job is still queued):
        the caller may then start streaming, and ``next_event`` goes on waiting for it."""
        task = asyncio.create_task(self.next_event())
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if done:
            return task.result()
        self._pending_first = task
        return None

    async def next_event(self) -> AnyEvent:
        """The next in-order event; raises RelayError for what the job's events cannot say."""
        if self._pending_first is not None:
            task, self._pending_first = self._pending_first, None
            return await task
        try:
            event = await self._next_in_order()
        except RedisError as exc:
            event_error = redis_unavailable(exc)
            self._observer.failed(event_error.spec.code or event_error.kind.value)
            self._log("failed", code=event_error.spec.code)
            raise event_error from exc
        except RelayError as error:
            self._observer.failed(error.spec.code or error.kind.value)
            self._log("failed", code=error.spec.code)
            raise
        self._observer.observe(event)
        if isinstance(event, StartEvent):
            self.prompt_tokens = event.prompt_tokens
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
        if self._pending_first is not None:
            self._pending_first.cancel()
            await asyncio.gather(self._pending_first, return_exceptions=True)
        services = self._services
        await services.router.unsubscribe(services.lifecycle.keys.job_events_channel(self.job_id))
        if self.is_finished or self.job.delivery.resumable or keep_job:
            return
        self._log("cancelled")
        try:
            await services.lifecycle.cancel([self.job_id])
        except RedisError:
            logger.warning("could not cancel job %s: Redis unavailable", self.job_id)

    def _log(self, event: str, **fields: object) -> None:
        log_transition(logger, event, self.job_id, self.job.request_id, **fields)

    async def _next_in_order(self) -> AnyEvent:
        cursor = self._cursor
        while (event := cursor.pop()) is None:
            if not (cursor.missing and await self._fill_gap()):
                cursor.take(await self._next_arrivals())
        if isinstance(event, EndEvent | ErrorEvent):
            self.is_finished = True
        return event

    async def _next_arrivals(self) -> list[AnyEvent]:
        """The next event off the channel; when the channel is silent, or was subscribed again
        after a break, what the job's log has from the cursor on."""
        try:
            async with asyncio.timeout(self._services.settings.liveness_check_interval_s):
                item = await self._queue.get()
        except TimeoutError:
            return await self._ride_out(self._check_silence) or []
        if isinstance(item, SubscriptionRenewed):
            self._outage.moved()
            logged = await self._ride_out(self._read_log) or []
            logger.info("job %s: subscribed again; %d events read from the log", self.job_id, len(logged))
            return logged
        return [self._decode(item)]

    async def _ride_out(self, read: Callable[[], Awaitable[list[AnyEvent]]]) -> list[AnyEvent] | None:
        """``read()``; None while Redis does not answer and a failover may still name a new
        primary (the caller tries again at its next turn), RedisError once waiting is pointless."""
        outage = self._outage
        was_failing = outage.is_failing
        try:
            events = await read()
        except RedisError as exc:
            if not outage.failed():
                raise
            if not was_failing:
                logger.warning("job %s: Redis is not answering (%s); waiting for a failover", self.job_id, exc)
            return None
        if was_failing:
            logger.info("job %s: Redis answers again", self.job_id)
        outage.answered()
        return events

    async def _read_log(self) -> list[AnyEvent]:
        return await self._services.lifecycle.read_log(self.job_id, self._cursor.next_seq)

    def _decode(self, payload: bytes) -> AnyEvent:
        """Anything but an event on the job's channel ends the stream with an error: the bytes
        did not come from a worker, and guessing past them could show the client wrong text."""
        try:
            return decode_event(payload)
        except (ValueError, ValidationError, TypeError) as exc:
            logger.error(
                "job %s: %d unreadable bytes on its channel (%s)", self.job_id, len(payload), type(exc).__name__
            )
            raise RelayError(
                ErrorKind.EVENT_UNREADABLE, f"job {self.job_id} received bytes that are not an event"
            ) from None

    async def _fill_gap(self) -> bool:
        """Pub/sub is at-most-once: events it dropped are read back from the job's log. False
        while the log cannot say yet: Redis is not answering, or a new primary is settling (its
        log lacks a job's last events until the job's worker writes them again)."""
        missing = self._cursor.missing
        logged = await self._ride_out(self._read_log)
        if logged is None:
            return False
        self._cursor.take(logged)
        if not self._cursor.missing:
            logger.info("job %s: %d events missed on pub/sub, read from the log", self.job_id, len(missing))
            return True
        if self._outage.is_settling:
            return False
        raise RelayError(
            ErrorKind.STREAM_GAP,
            f"events {missing.start}..{missing.stop - 1} of job {self.job_id} were lost in transit",
        )

    async def _check_silence(self) -> list[AnyEvent]:
        """While the job is silent: is the client still there, did pub/sub lose events, and is
        the job still being served? Returns the events the log has that the channel did not bring."""
        if self._is_disconnected is not None and await self._is_disconnected():
            raise ClientDisconnected()
        lifecycle = self._services.lifecycle
        record = await lifecycle.record(self.job_id)
        if record is None:
            raise RelayError(
                ErrorKind.INTERNAL,
                f"job {self.job_id} is gone from Redis (restarted without its data, or a failover lost it)",
            )
        if record.next_seq > self._cursor.next_seq:
            missed = await self._read_log()
            if missed:
                logger.info("job %s: %d events missed on pub/sub, read from the log", self.job_id, len(missed))
                return missed
        if record.state.is_final:
            raise RelayError(ErrorKind.INTERNAL, f"job {self.job_id} ended ({record.state}) but its log lost the end")
        if not self._outage.is_settling:  # a heartbeat missed while Redis was away is no one's fault
            await self._orphans.settle(record, "stream", self.job.request_id)
        return []
