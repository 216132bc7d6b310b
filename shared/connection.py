"""The one way both processes connect to Redis: every command has a timeout, so a frozen Redis
(process stopped, sockets open) makes calls fail within seconds instead of hanging them."""

from __future__ import annotations

import asyncio
import logging

from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

logger = logging.getLogger("relaylm.redis")

_CONNECT_TIMEOUT_S = 1.0
# Longest any one command may take; a pub/sub reader polls with its own shorter timeout.
COMMAND_TIMEOUT_S = 2.0
_RETRY_MAX_S = 5.0
# Connections one process opens at most. A burst of requests past it waits its turn for a
# connection (up to one command timeout) instead of failing: redis-py's plain pool raises
# MaxConnectionsError at its 100th concurrent command, which a 200-stream burst reaches.
MAX_CONNECTIONS = 64


def _stale_socket_retry() -> Retry:
    """Once more, on a fresh connection, when a pooled one turns out dead (Redis restarted, or an
    idle socket cut): without it, each of up to MAX_CONNECTIONS stale sockets fails one request
    with a 503 after Redis is back. Timeouts are not retried: a frozen Redis must fail fast."""
    return Retry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,))


def connect_redis(redis_url: str) -> Redis:
    """A lazily connecting client: the first command connects, so start-up never blocks on Redis."""
    pool = BlockingConnectionPool.from_url(
        redis_url,
        max_connections=MAX_CONNECTIONS,
        timeout=COMMAND_TIMEOUT_S,
        socket_connect_timeout=_CONNECT_TIMEOUT_S,
        socket_timeout=COMMAND_TIMEOUT_S,
        retry=_stale_socket_retry(),
    )
    return Redis(connection_pool=pool)


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
