"""Job events → the job's log and channel, through the lifecycle's fenced ``append``.

The engine thread publishes each step's events itself, in one pipelined round trip, with a
synchronous client: handing them to the event loop first cost a thread hop and, with both
cores busy decoding, a scheduling delay on the time-to-first-token path.

Nothing is dropped: events that could not be written (Redis down or restarting) stay in the
job's outbox and are written again, in order, by the next step or by a retry thread, until
Redis takes them or refuses them. A refusal means the job is not ours any more (taken over
after this worker was paused, cancelled, or lost in a Redis restart): the job's future says so
and its runner stops generating. A gap (events a Redis restart lost from the log) is filled
from the copy every job keeps of what it sent.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from redis.exceptions import RedisError

from shared.events import DeltaEvent, EndEvent, ErrorEvent, encode_event
from shared.job_lifecycle import AppendReply, AppendRequest, AppendStatus, EventAppender, JobState
from shared.redis import RedisTarget, connect_sync_redis
from shared.redis_keys import RedisKeys
from worker.engine.engine import RequestOutput

logger = logging.getLogger(__name__)

_SOCKET_TIMEOUT_S = 2.0
_RETRY_INTERVAL_S = 0.25


class PublishOutcome(StrEnum):
    DONE = "done"  # the final event is in the log (or the job ended with nothing to say)
    LOST = "lost"  # the job is not this worker's any more
    REPLACED = "replaced"  # a newer claim of the job on this worker publishes for it now


@dataclass
class _Outbox:
    """One job's events: all it sent (for refilling a gap) and those not yet written."""

    epoch: int
    instance: str  # the claiming process (with the epoch, what the writes are fenced by)
    future: asyncio.Future[PublishOutcome]
    sent: dict[int, bytes] = field(default_factory=dict)
    unsent: list[tuple[int, bytes]] = field(default_factory=list)
    final_state: JobState | None = None
    is_done: bool = False
    num_uncharged_tokens: int = 0  # output tokens not yet charged to the job's tenant (its fair share)

    def add(self, output: RequestOutput) -> None:
        for event in output.events:
            payload = encode_event(event)
            self.sent[event.seq] = payload
            self.unsent.append((event.seq, payload))
            if isinstance(event, DeltaEvent):
                self.num_uncharged_tokens += len(event.token_ids)
            elif isinstance(event, EndEvent):
                self.final_state = JobState.FINISHED
            elif isinstance(event, ErrorEvent):
                self.final_state = JobState.FAILED
        self.is_done = self.is_done or output.is_done


class EventPublisher:
    def __init__(self, target: RedisTarget, keys: RedisKeys) -> None:
        client = connect_sync_redis(target, _SOCKET_TIMEOUT_S)
        self._client = client
        self._appender = EventAppender(client, keys)
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._outboxes: dict[str, _Outbox] = {}
        self._failing_since: float | None = None
        self._retry_wanted = threading.Event()
        self._closed = False
        self._retry_thread = threading.Thread(target=self._retry_forever, name="relaylm-publish-retry", daemon=True)
        self._retry_thread.start()

    def expect(self, job_id: str, epoch: int, instance: str = "") -> asyncio.Future[PublishOutcome]:
        """Start publishing a job this worker claimed under ``epoch`` (as process ``instance``,
        '' for writes fenced by the epoch alone); the future resolves once
        its final event is written, or the job turns out not to be ours. An earlier claim's
        future, if the job had one here, resolves as replaced."""
        future: asyncio.Future[PublishOutcome] = self._loop.create_future()
        with self._lock:
            earlier = self._outboxes.get(job_id)
            self._outboxes[job_id] = _Outbox(epoch, instance, future)
        if earlier is not None:
            _resolve(earlier.future, PublishOutcome.REPLACED)
        return future

    def is_publishing(self, job_id: str, epoch: int, instance: str = "") -> bool:
        """Whether the job's events are being written under this claim (its final event not yet)."""
        with self._lock:
            box = self._outboxes.get(job_id)
            return box is not None and (box.epoch, box.instance) == (epoch, instance)

    def forget(self, job_id: str) -> None:
        """Stop publishing for a job (its runner gave it up); later events of it are dropped."""
        with self._lock:
            self._outboxes.pop(job_id, None)

    def sink(self, outputs: list[RequestOutput]) -> None:
        """The engine's sink, called on the engine thread once per step. While Redis fails, the
        retry thread alone writes: each try can take a command timeout, which the engine's
        steps must not wait for."""
        with self._lock:
            for output in outputs:
                box = self._outboxes.get(output.request_id)
                if box is not None:
                    box.add(output)
            if self._failing_since is None:
                self._flush()

    async def publish(self, output: RequestOutput) -> None:
        """Events made on the event loop (a job rejected before it reached the engine)."""
        await asyncio.to_thread(self.sink, [output])

    def close(self) -> None:
        self._closed = True
        self._retry_wanted.set()
        self._client.close()

    # -- writing (lock held) ------------------------------------------------------------------
    def _flush(self) -> None:
        pending = [(job_id, box) for job_id, box in self._outboxes.items() if box.unsent or box.is_done]
        if not pending:
            return
        requests = [
            AppendRequest(job_id, box.epoch, list(box.unsent), box.final_state, box.num_uncharged_tokens, box.instance)
            for job_id, box in pending
        ]
        try:
            replies = self._appender.append(requests)
        except RedisError as exc:
            if self._failing_since is None:
                logger.warning("writing events of %d jobs failed (%s); retrying until Redis answers", len(pending), exc)
                self._failing_since = time.monotonic()
            self._retry_wanted.set()
            return
        if self._failing_since is not None:
            logger.info("events written again after %.1f s", time.monotonic() - self._failing_since)
            self._failing_since = None
        for (job_id, box), reply in zip(pending, replies, strict=True):
            self._settle(job_id, box, reply)

    def _settle(self, job_id: str, box: _Outbox, reply: AppendReply) -> None:
        if reply.status is not AppendStatus.REFUSED:
            box.num_uncharged_tokens = 0
        if reply.status is AppendStatus.REFUSED:
            logger.info("job %s: events refused (cancelled, or moved on without this worker); stopping it", job_id)
            self._finish(job_id, box, PublishOutcome.LOST)
        elif reply.status is AppendStatus.GAP:
            missing = [(seq, payload) for seq, payload in sorted(box.sent.items()) if seq >= reply.next_seq]
            logger.warning("job %s: its log lost events from %d on; writing them again", job_id, reply.next_seq)
            box.unsent = missing
            self._retry_wanted.set()
        else:
            box.unsent = []
            if box.is_done:
                self._finish(job_id, box, PublishOutcome.DONE)

    def _finish(self, job_id: str, box: _Outbox, outcome: PublishOutcome) -> None:
        self._outboxes.pop(job_id, None)
        self._loop.call_soon_threadsafe(_resolve, box.future, outcome)

    def _retry_forever(self) -> None:
        while not self._closed:
            self._retry_wanted.wait()
            self._retry_wanted.clear()
            if self._closed:
                return
            time.sleep(_RETRY_INTERVAL_S)
            with self._lock:
                self._flush()


def _resolve(future: asyncio.Future[PublishOutcome], outcome: PublishOutcome) -> None:
    if not future.done():
        future.set_result(outcome)
