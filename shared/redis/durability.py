"""Writes that must outlive a failover: a replica's acknowledgement, or a refusal."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.sentinel import MasterNotFoundError

from shared.redis.following import FollowingPool

logger = logging.getLogger("relaylm.redis")


class ReplicaAck:
    """Writes that must outlive a failover: replication is asynchronous, so a primary that dies
    can take its last acknowledged writes with it. A request relaylm accepted (a job, a batch,
    an uploaded file) is written, then ``WAIT 1 <timeout_ms>`` holds the reply until a replica
    has it. Past the timeout the request is accepted anyway (a replica that is down must not stop
    the service) and a warning says so, at most once a minute.

    WAIT counts a connection's own writes, so it follows them on the same connection: in the same
    pipeline (:meth:`write`), or, after a transaction that released its connection, behind a
    write of a marker (:meth:`confirm`): the replication offset only grows, so a replica that has
    the marker has everything written before it.

    Every wait writes a marker of its own (``marker_key`` plus a random token, expiring), and a
    wait that no replica acknowledged checks that the marker is on the primary the sentinels (or
    the cluster) name *now*: a primary that was frozen, replaced and thawed takes writes, without
    replicas, until it is demoted, and a connection pooled before the failover may write there in
    the second before its pool learns of the new primary. Such a write is not accepted: it fails
    as a connection error (503; the client's retry lands on the new primary)."""

    def __init__(
        self, timeout_ms: int, marker_key: str = "", on_unacknowledged: Callable[[], None] | None = None
    ) -> None:
        self.timeout_ms = timeout_ms  # 0: nothing waits (one Redis, no replica to wait for)
        self._marker_key = marker_key
        self._on_unacknowledged = on_unacknowledged
        self._warned_at = 0.0

    async def execute(self, redis: Redis, pipe: Pipeline, what: str) -> list[Any]:
        """Run ``pipe`` (queued without a transaction) and, when waiting, WAIT after it."""
        if self.timeout_ms <= 0:
            replies: list[Any] = await pipe.execute()
            return replies
        marker = f"{self._marker_key}:{uuid.uuid4().hex}"
        pipe.set(marker, b"1", px=_MARKER_TTL_MS)
        pipe.execute_command("WAIT", 1, self.timeout_ms)
        replies = await pipe.execute()
        acked = replies[-1]
        del replies[-2:]
        if int(acked) < 1:
            await self._check_still_primary(redis, marker, what)
            if self._on_unacknowledged is not None:
                self._on_unacknowledged()
            now = time.monotonic()
            if now - self._warned_at > 60:
                self._warned_at = now
                logger.warning(
                    "%s: no replica acknowledged it within %d ms; a failover now could lose it", what, self.timeout_ms
                )
        return replies

    @staticmethod
    async def _check_still_primary(redis: Redis, marker: str, what: str) -> None:
        pool = redis.connection_pool
        if not isinstance(pool, FollowingPool):
            return
        # A moment's doubt (a sentinel slow to answer, or not yet told of a failover) is waited
        # out: refusing then would fail a write the primary holds.
        deadline = time.monotonic() + _DOUBT_WAIT_S
        while True:
            try:
                await pool.primary()  # the pool's connections to any other server are closed before use
                break
            except MasterNotFoundError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_DOUBT_RETRY_S)
        if not await redis.exists(marker):
            raise redis_errors.ConnectionError(f"{what} was written to a former primary; not accepted")

    async def write(self, redis: Redis, what: str, queue: Callable[[Pipeline], Awaitable[None] | None]) -> list[Any]:
        """``queue`` adds the writes to a pipeline; they run on one connection, then the WAIT."""
        pipe = redis.pipeline(transaction=False)
        queued = queue(pipe)
        if queued is not None:
            await queued
        return await self.execute(redis, pipe, what)

    async def confirm(self, redis: Redis, what: str) -> None:
        """Wait for a replica to have every write made before this call."""
        if self.timeout_ms > 0:
            await self.execute(redis, redis.pipeline(transaction=False), what)


_MARKER_TTL_MS = 60_000
# How long a write no replica acknowledged waits for the sentinels to agree on the primary.
_DOUBT_WAIT_S = 2.0
_DOUBT_RETRY_S = 0.1
NO_REPLICA_ACK = ReplicaAck(0)
