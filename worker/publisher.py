"""Job events → Redis pub/sub.

Every event is appended to the job's event log (a Redis Stream) and published on its channel.
The engine thread publishes each step's events itself, in one pipelined round trip, with a
synchronous client: handing them to the event loop first cost a thread hop and, with both
cores busy decoding, a scheduling delay on the time-to-first-token path. Publishing on the
engine thread also keeps a job's events in order (its start event travels with the engine's
first output for it). The event loop publishes only what it makes itself (rejections) and
waits on per-job futures that resolve once a job's final event is out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis
from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.events import encode_event
from shared.redis_keys import JOB_LOG_MAX_EVENTS, JOB_LOG_TTL_S, RedisKeys
from worker.engine.engine import RequestOutput

logger = logging.getLogger(__name__)

_SOCKET_TIMEOUT_S = 5.0


class EventPublisher:
    def __init__(self, redis_url: str, async_redis: Redis, keys: RedisKeys) -> None:
        self._sync = redis.Redis.from_url(redis_url, socket_connect_timeout=2.0, socket_timeout=_SOCKET_TIMEOUT_S)
        self._async = async_redis
        self._keys = keys
        self._loop = asyncio.get_running_loop()
        self._done: dict[str, asyncio.Future[None]] = {}

    def expect(self, job_id: str) -> asyncio.Future[None]:
        """A future that resolves when the job's final event has been published."""
        future = self._loop.create_future()
        self._done[job_id] = future
        return future

    def sink(self, outputs: list[RequestOutput]) -> None:
        """The engine's sink, called on the engine thread once per step."""
        try:
            pipe = self._sync.pipeline(transaction=False)
            for output in outputs:
                self._queue_output(pipe, output)
            pipe.execute()
        except RedisError:
            # The API notices the silence (liveness checks) and ends the stream with an error.
            logger.exception("publishing %d job outputs failed", len(outputs))
        finished = [output.request_id for output in outputs if output.is_done]
        if finished:
            self._loop.call_soon_threadsafe(self._resolve, finished)

    async def publish(self, output: RequestOutput) -> None:
        """Publish events made on the event loop (a job rejected before it reached the engine)."""
        try:
            async with self._async.pipeline(transaction=False) as pipe:
                self._queue_output(pipe, output)
                await pipe.execute()
        except RedisError:
            logger.exception("publishing events of job %s failed", output.request_id)
        if output.is_done:
            self._resolve([output.request_id])

    def _queue_output(self, pipe: Any, output: RequestOutput) -> None:
        """Each event goes into the job's log (replay, gaps, resuming elsewhere) and out live."""
        if not output.events:
            return
        log, channel = self._keys.job_event_log(output.request_id), self._keys.job_events_channel(output.request_id)
        for event in output.events:
            payload = encode_event(event)
            pipe.xadd(log, {"e": payload}, maxlen=JOB_LOG_MAX_EVENTS, approximate=True)
            pipe.publish(channel, payload)
        pipe.expire(log, JOB_LOG_TTL_S)

    def close(self) -> None:
        self._sync.close()

    def _resolve(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            future = self._done.pop(job_id, None)
            if future is not None and not future.done():
                future.set_result(None)
