"""The one way both processes connect to Redis: arq's client with msgpack (never pickle)."""

from __future__ import annotations

import asyncio
import logging

from arq.connections import ArqRedis
from redis import exceptions as redis_errors
from redis.asyncio import ConnectionPool, Redis

from shared import serialization

logger = logging.getLogger("relaylm.redis")

_CONNECT_TIMEOUT_S = 1.0
_RETRY_MAX_S = 5.0


def connect_redis(redis_url: str, default_queue_name: str = "arq:queue") -> ArqRedis:
    """A lazily connecting client: the first command connects, so start-up never blocks on Redis."""
    pool = ConnectionPool.from_url(redis_url, socket_connect_timeout=_CONNECT_TIMEOUT_S)
    return ArqRedis(
        pool,
        job_serializer=serialization.serialize,
        job_deserializer=serialization.deserialize,
        default_queue_name=default_queue_name,
    )


def redacted(url: str) -> str:
    """The URL fit for a log line: never a Redis password."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


class RedisRefused(RuntimeError):
    """Redis answers but will not take us (wrong password, protected mode): retrying cannot help."""


async def wait_for_redis(redis: Redis, redis_url: str, stop: asyncio.Event) -> bool:
    """Until Redis answers a PING: a worker on another host may well start before Redis does.

    False when ``stop`` was set first; ``RedisRefused`` when Redis rejects the connection."""
    delay = 0.25
    while not stop.is_set():
        try:
            await redis.ping()
            return True
        except (redis_errors.AuthenticationError, redis_errors.ResponseError) as exc:
            raise RedisRefused(f"Redis at {redacted(redis_url)} refused the connection: {exc}") from exc
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            logger.warning("Redis at %s does not answer (%s); retrying in %.1f s", redacted(redis_url), exc, delay)
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            delay = min(delay * 2, _RETRY_MAX_S)
    return False
