"""The worker's control channels: queue wake-up pings and job cancellations, on one pub/sub
connection that re-subscribes by itself after a Redis hiccup."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.redis import subscription_follows_primary
from shared.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

Handler = Callable[[bytes], None]
_RETRY_DELAY_S = 0.5
# Reads poll: a blocking read would hit the connection's command timeout on a quiet channel.
_READ_POLL_S = 1.0
# How often the subscription checks it still listens to the primary (under Sentinel).
_PRIMARY_CHECK_S = 2.0


class ControlListener:
    def __init__(self, redis: Redis, handlers: dict[str, Handler], sharded: bool = False) -> None:
        """``sharded``: the channels are shard channels (Redis Cluster)."""
        self._redis = redis
        self._handlers = handlers
        self._sharded = sharded
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="relaylm-control")
        await self._subscribed.wait()

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                if self._sharded:
                    await pubsub.ssubscribe(*self._handlers)
                else:
                    await pubsub.subscribe(*self._handlers)
                self._subscribed.set()
                checked_at = asyncio.get_running_loop().time()
                while True:
                    message = await pubsub.get_message(timeout=_READ_POLL_S)
                    if message is not None and message["type"] in ("message", "smessage"):
                        self._dispatch(message["channel"], message["data"])
                    if asyncio.get_running_loop().time() - checked_at > _PRIMARY_CHECK_S:
                        checked_at = asyncio.get_running_loop().time()
                        if not await subscription_follows_primary(self._redis, pubsub):
                            logger.warning("the Redis primary moved; subscribing there")
                            break  # a new subscription, on a new connection
            except RedisError as exc:
                logger.warning("control channel lost (%s); resubscribing", exc)
                await asyncio.sleep(_RETRY_DELAY_S)
            finally:
                await pubsub.aclose()

    def _dispatch(self, channel: bytes | str, data: bytes) -> None:
        name = channel.decode() if isinstance(channel, bytes) else channel
        handler = self._handlers.get(name)
        if handler is not None:
            handler(data)
