"""One pub/sub connection per API process, fanned out to per-job queues.

A connection per stream would cost Redis a client per open request; instead channels are
(un)subscribed on one shared connection. ``subscribe`` returns only once Redis confirmed the
subscription, so a job enqueued afterwards cannot publish into the void.

The router owns the subscription. When it breaks (the primary died, or a failover named another
one) the router connects to the primary of the moment, with a backoff, and subscribes every open
channel again; once Redis confirmed that, it puts :data:`RENEWED` on every open stream's queue:
what the jobs published in between never reached this process, and each stream reads it from its
job's log (see :mod:`api.jobs.stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.errors import ErrorKind, RelayError
from shared.redis import COMMAND_TIMEOUT_S, subscription_follows_primary
from shared.redis_keys import RedisKeys
from shared.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

_SUBSCRIBE_TIMEOUT_S = COMMAND_TIMEOUT_S
# Reads poll: a blocking read would hit the connection's command timeout whenever no job talks.
_READ_POLL_S = 1.0
# Between tries to subscribe again: doubling from the first to the last, so a failover (seconds)
# is followed closely and a long outage costs Redis one try every two seconds.
_RETRY_FIRST_DELAY_S = 0.1
_RETRY_MAX_DELAY_S = 2.0
# How often the subscription checks it still listens to the primary (under Sentinel).
_PRIMARY_CHECK_S = 2.0


class SubscriptionRenewed:
    """On a stream's queue: the channel was subscribed again after a break; what the job
    published meanwhile is in its log only."""

    def __repr__(self) -> str:
        return "RENEWED"


RENEWED = SubscriptionRenewed()
ChannelItem = bytes | SubscriptionRenewed


class EventRouter:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._pubsub = redis.pubsub()
        # A channel of our own keeps the connection subscribed (and readable) when no job is open.
        self._home_channel = keys.api_channel(uuid.uuid4().hex)
        self._sharded = keys.sharded_channels
        self._queues: dict[str, asyncio.Queue[ChannelItem]] = {}
        self._confirmations: dict[str, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None
        # Set when the subscription broke or moved: the streams hear of it once Redis confirms
        # the home channel again (subscribed after, or with, every other channel).
        self._is_renewing = False
        self._num_failed_tries = 0  # since the subscription was last confirmed
        # A subscription Redis did not confirm in time: the connection is dropped and made again,
        # to the primary of the moment (it may listen to a server that no longer answers it).
        self._is_unconfirmed = False

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_forever(), name="relaylm-event-router")

    async def stop(self) -> None:
        if self._reader is not None:
            await cancel_and_wait(self._reader)
        with contextlib.suppress(RedisError):
            await self._pubsub.aclose()

    async def subscribe(self, channel: str) -> asyncio.Queue[ChannelItem]:
        queue: asyncio.Queue[ChannelItem] = asyncio.Queue()
        confirmed = asyncio.get_running_loop().create_future()
        self._queues[channel] = queue
        self._confirmations[channel] = confirmed
        try:
            await self._subscribe(channel)
            await asyncio.wait_for(confirmed, _SUBSCRIBE_TIMEOUT_S)
        except (RedisError, TimeoutError) as exc:
            self._forget(channel)
            self._is_unconfirmed = self._is_unconfirmed or isinstance(exc, TimeoutError)
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
                # After a break this connects to the primary of the moment, and redis-py
                # subscribes every channel the connection had before the home channel again.
                await self._subscribe(self._home_channel)
                await self._read_until_broken()
            except (RedisError, OSError, TimeoutError) as exc:
                if not self._is_renewing:
                    logger.warning("event subscription lost (%r); subscribing again", exc)
                await self._drop_connection()
                await asyncio.sleep(self._retry_delay_s())
            except Exception:
                # Whatever broke it, the reader must go on: without it no stream starts.
                logger.exception("event subscription failed; subscribing again")
                await self._drop_connection()
                await asyncio.sleep(self._retry_delay_s())

    async def _drop_connection(self) -> None:
        """The next subscribe connects again, to the primary of the moment."""
        self._is_renewing = True
        connection = self._pubsub.connection
        if connection is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await connection.disconnect()

    def _retry_delay_s(self) -> float:
        delay_s = min(_RETRY_FIRST_DELAY_S * 2**self._num_failed_tries, _RETRY_MAX_DELAY_S)
        self._num_failed_tries = min(self._num_failed_tries + 1, 16)
        return delay_s

    async def _read_until_broken(self) -> None:
        loop = asyncio.get_running_loop()
        checked_at = loop.time()
        while True:
            message = await self._pubsub.get_message(timeout=_READ_POLL_S)
            if message is not None:
                self._route(message)
            if self._is_unconfirmed:
                self._is_unconfirmed = False
                raise redis_errors.ConnectionError("Redis did not confirm a subscription in time")
            if loop.time() - checked_at > _PRIMARY_CHECK_S:
                checked_at = loop.time()
                if not await subscription_follows_primary(self._redis, self._pubsub):
                    logger.warning("the Redis primary moved; subscribing there")
                    await self._move_subscription()

    async def _move_subscription(self) -> None:
        """Drop the connection to the old primary: the next subscribe connects to the new one and
        subscribes every channel again (events published meanwhile come from the jobs' logs)."""
        self._is_renewing = True
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
            if name == self._home_channel and self._is_renewing:
                self._renewed()

    def _renewed(self) -> None:
        """Every channel is subscribed again: each open stream reads what it missed from its log."""
        self._is_renewing = False
        self._num_failed_tries = 0
        logger.info(
            "event subscription renewed; %d open streams read what they missed from their logs", len(self._queues)
        )
        for queue in self._queues.values():
            queue.put_nowait(RENEWED)
