"""One pub/sub connection per API process, fanned out to per-job queues.

A connection per stream would cost Redis a client per open request; instead channels are
(un)subscribed on one shared connection. ``subscribe`` returns only once Redis confirmed the
subscription, so a job enqueued afterwards cannot publish into the void.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.connection import COMMAND_TIMEOUT_S, subscription_follows_primary
from shared.errors import ErrorKind, RelayError
from shared.redis_keys import RedisKeys
from shared.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

_SUBSCRIBE_TIMEOUT_S = COMMAND_TIMEOUT_S
# Reads poll: a blocking read would hit the connection's command timeout whenever no job talks.
_READ_POLL_S = 1.0
_RETRY_DELAY_S = 0.5
# How often the subscription checks it still listens to the primary (under Sentinel).
_PRIMARY_CHECK_S = 2.0


class EventRouter:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._pubsub = redis.pubsub()
        # A channel of our own keeps the connection subscribed (and readable) when no job is open.
        self._home_channel = keys.api_channel(uuid.uuid4().hex)
        self._sharded = keys.sharded_channels
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._confirmations: dict[str, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_forever(), name="relaylm-event-router")

    async def stop(self) -> None:
        if self._reader is not None:
            await cancel_and_wait(self._reader)
        with contextlib.suppress(RedisError):
            await self._pubsub.aclose()

    async def subscribe(self, channel: str) -> asyncio.Queue[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        confirmed = asyncio.get_running_loop().create_future()
        self._queues[channel] = queue
        self._confirmations[channel] = confirmed
        try:
            await self._subscribe(channel)
            await asyncio.wait_for(confirmed, _SUBSCRIBE_TIMEOUT_S)
        except (RedisError, TimeoutError) as exc:
            self._forget(channel)
            raise RelayError(ErrorKind.REDIS_UNAVAILABLE, "Redis is not answering; try again shortly") from exc
        return queue

    async def unsubscribe(self, channel: str) -> None:
        self._forget(channel)
        with contextlib.suppress(RedisError):
            if self._sharded:
                await self._pubsub.sunsubscribe(channel)
            else:
                await self._pubsub.unsubscribe(channel)

    async def _subscribe(self, channel: str) -> None:
        if self._sharded:
            await self._pubsub.ssubscribe(channel)
        else:
            await self._pubsub.subscribe(channel)

    def _forget(self, channel: str) -> None:
        self._queues.pop(channel, None)
        future = self._confirmations.pop(channel, None)
        if future is not None and not future.done():
            future.cancel()

    async def _read_forever(self) -> None:
        while True:
            try:
                await self._subscribe(self._home_channel)
                checked_at = asyncio.get_running_loop().time()
                while True:
                    message = await self._pubsub.get_message(timeout=_READ_POLL_S)
                    if message is not None:
                        self._route(message)
                    if asyncio.get_running_loop().time() - checked_at > _PRIMARY_CHECK_S:
                        checked_at = asyncio.get_running_loop().time()
                        if not await subscription_follows_primary(self._redis, self._pubsub):
                            logger.warning("the Redis primary moved; subscribing there")
                            await self._move_subscription()
            except RedisError as exc:
                logger.warning("event subscription lost (%s); reconnecting", exc)
                await asyncio.sleep(_RETRY_DELAY_S)

    async def _move_subscription(self) -> None:
        """Drop the connection to the old primary: the next subscribe connects to the new one and
        subscribes every channel again (events published meanwhile come from the jobs' logs)."""
        connection = self._pubsub.connection
        if connection is not None:
            await connection.disconnect()
        await self._subscribe(self._home_channel)

    def _route(self, message: dict[str, object]) -> None:
        channel = message["channel"]
        name = channel.decode() if isinstance(channel, bytes) else str(channel)
        if message["type"] in ("message", "smessage"):
            queue = self._queues.get(name)
            if queue is not None:
                queue.put_nowait(message["data"])  # type: ignore[arg-type]
        elif message["type"] in ("subscribe", "ssubscribe"):
            future = self._confirmations.pop(name, None)
            if future is not None and not future.done():
                future.set_result(None)
