"""The one way every process connects to Redis (``connect_redis``, and ``connect_sync_redis`` for
threads outside the event loop): every command has a timeout, so a frozen Redis
(process stopped, sockets open) makes calls fail within seconds instead of hanging them.

Redis is one server (``--redis-url``), a primary that Sentinel names (``--redis-sentinels``), or
the primary of a Redis Cluster (``--redis-cluster-nodes``) that serves the one slot every relaylm
key of a deployment lives in (the keys share the hash tag ``{prefix}``, so every script, pipeline
and transaction stays in one slot). Either way a "primary" is followed through failovers: every
new connection asks the sentinels, or the cluster's nodes, where it is; a connection to a primary
that was demoted (``READONLY``, or ``MOVED`` in a cluster) is dropped and the command retried on
the new one; and a long-lived subscription checks that it still listens to the primary
(:func:`subscription_follows_primary`): a frozen old primary keeps its subscribers' sockets open
without a word, so nothing else would move them.

Where the primary is, is decided in ``primary.py`` from the servers' answers; this module asks
the servers and keeps connections on the primary, written once for redis-py's asyncio client
(``FollowingPool``, ``_PrimaryConnection``) with thin shells for its blocking one. They override
redis-py internals (``connect_to``, ``connect_check_health``, ``read_response``,
``get_connection``); ``pyproject.toml`` pins redis-py to a minor range, and
``tests/shared/test_redis_internals.py`` fails when one of those changes its signature.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import redis as sync_redis
import redis.sentinel as sync_sentinel
from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.retry import Retry as SyncRetry

from shared.redis.primary import (
    IN_DOUBT,
    ClusterNode,
    PrimaryInDoubt,
    SentinelState,
    agreed_primary,
    cluster_nodes_text,
    newly_named,
    parse_cluster_nodes,
    slot_owner,
)
from shared.redis.target import Address, RedisTarget

logger = logging.getLogger("relaylm.redis")

_CONNECT_TIMEOUT_S = 1.0
# Longest any one command may take; a pub/sub reader polls with its own shorter timeout.
COMMAND_TIMEOUT_S = 2.0
_RETRY_MAX_S = 5.0
# Connections one process opens at most. A burst of requests past it waits its turn for a
# connection (up to one command timeout) instead of failing: redis-py's plain pool raises
# MaxConnectionsError at its 100th concurrent command, which a 200-stream burst reaches.
MAX_CONNECTIONS = 64
# How often a Sentinel pool asks where the primary is (besides on every new connection), and how
# long a command waits for that answer.
_PRIMARY_REFRESH_S = 1.0
_PRIMARY_REFRESH_WAIT_S = 0.05


def _stale_socket_retry() -> Retry:
    """Once more, on a fresh connection, when a pooled one turns out dead (Redis restarted, or an
    idle socket cut): without it, each of up to MAX_CONNECTIONS stale sockets fails one request
    with a 503 after Redis is back. Timeouts are not retried: a frozen Redis must fail fast."""
    return Retry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,))


class _AgreedPrimarySentinel(Sentinel):
    """Asks every sentinel, not the first that answers (see :func:`agreed_primary`)."""

    async def discover_master(self, service_name: str) -> Address:
        async def ask(sentinel: Redis) -> SentinelState | None:
            try:
                masters: dict[str, SentinelState] = await sentinel.sentinel_masters()  # type: ignore[assignment]
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                return None
            return masters.get(service_name)

        answers = await asyncio.gather(*(ask(sentinel) for sentinel in self.sentinels))
        return agreed_primary(list(answers), service_name, lambda state: self.check_master_state(state, service_name))


class _AgreedPrimarySyncSentinel(sync_sentinel.Sentinel):
    """The blocking client's :class:`_AgreedPrimarySentinel`."""

    def discover_master(self, service_name: str) -> Address:
        answers: list[SentinelState | None] = []
        for sentinel in self.sentinels:
            try:
                masters: dict[str, SentinelState] = sentinel.sentinel_masters()  # type: ignore[assignment]
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                answers.append(None)
                continue
            answers.append(masters.get(service_name))
        return agreed_primary(answers, service_name, lambda state: self.check_master_state(state, service_name))


class _ClusterSlotOwner(Sentinel):
    """Plays the sentinels' part for a Redis Cluster: the primary to follow is the node serving
    the slot of relaylm's hash tag, and every node (the ones given, and the ones they name) is
    asked where it is. ``service_name`` is unused: the slot is the service."""

    def __init__(self, nodes: tuple[Address, ...], slot: int, node_kwargs: dict[str, Any]) -> None:
        # A node that is down is skipped at once: no retry of its own holds the answer up.
        asking = {**node_kwargs, "retry": Retry(NoBackoff(), 0)}
        super().__init__(list(nodes), sentinel_kwargs=asking, **node_kwargs)
        self.slot = slot
        self._known = set(nodes)

    async def discover_master(self, service_name: str) -> Address:
        async def ask(node: Redis) -> list[ClusterNode] | None:
            try:
                return parse_cluster_nodes(cluster_nodes_text(await node.execute_command("CLUSTER", "NODES")))
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                return None

        views = [view for view in await asyncio.gather(*(ask(node) for node in self.sentinels)) if view is not None]
        for host, port in newly_named(views, self._known):
            self.sentinels.append(Redis(host=host, port=port, **self.sentinel_kwargs))
        return slot_owner(views, self.slot)


class _SyncClusterSlotOwner(sync_sentinel.Sentinel):
    """The blocking client's :class:`_ClusterSlotOwner`."""

    def __init__(self, nodes: tuple[Address, ...], slot: int, node_kwargs: dict[str, Any]) -> None:
        asking = {**node_kwargs, "retry": SyncRetry(NoBackoff(), 0)}
        super().__init__(list(nodes), sentinel_kwargs=asking, **node_kwargs)
        self.slot = slot
        self._known = set(nodes)

    def discover_master(self, service_name: str) -> Address:
        views = []
        for node in list(self.sentinels):
            try:
                views.append(parse_cluster_nodes(cluster_nodes_text(node.execute_command("CLUSTER", "NODES"))))
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                continue
        for host, port in newly_named(views, self._known):
            self.sentinels.append(sync_redis.Redis(host=host, port=port, **self.sentinel_kwargs))
        return slot_owner(views, self.slot)


def _moved_away(pool: Any, error: redis_errors.ResponseError) -> redis_errors.RedisError:
    """What a cluster's redirection means to a connection that follows one slot's primary: the
    slot moved (a failover), so reconnect and retry there (a connection error); a redirection to
    another slot is a key outside relaylm's hash tag, a bug no retry can help."""
    slot = getattr(pool.sentinel_manager, "slot", None)
    if not isinstance(error, redis_errors.MovedError):  # CLUSTERDOWN, TRYAGAIN: any shard's failover
        return redis_errors.ConnectionError(f"the cluster refused the command ({error}); a failover under way?")
    if slot is not None and error.slot_id != slot:
        return redis_errors.ResponseError(f"a key outside the deployment's hash tag (slot {error.slot_id}): {error}")
    return redis_errors.ConnectionError(f"the cluster moved relaylm's slot ({error})")


_REDIRECTIONS = (redis_errors.MovedError, redis_errors.ClusterDownError, redis_errors.TryAgainError)


class _PrimaryConnection(SentinelManagedConnection):
    """redis-py's Sentinel connection asks where the primary is when the pool opens it, but a
    socket it closed (an error, a retry) is opened again at its old address: the former
    primary's, after a failover. This one asks the sentinels again whenever it reconnects."""

    _addressed = False  # inside connect_to: the address was just asked for

    async def connect_to(self, address: Any) -> None:
        self._addressed = True
        try:
            await super().connect_to(address)
        finally:
            self._addressed = False

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if not self.is_connected and not self._addressed:
            self.host, self.port = await self.connection_pool.primary()
        await super().connect_check_health(*args, **kwargs)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except _REDIRECTIONS as exc:
            await self.disconnect()
            raise _moved_away(self.connection_pool, exc) from exc


class _PrimarySSLConnection(_PrimaryConnection, SSLConnection):
    pass


class _SyncPrimaryConnection(sync_sentinel.SentinelManagedConnection):
    """The blocking :class:`_PrimaryConnection`, which also closes its socket after a failed
    read (redis-py's keeps it: the late reply of a timed-out command then answers the next one,
    sent to a primary that may have been replaced meanwhile)."""

    _addressed = False

    def connect_to(self, address: Any) -> None:
        self._addressed = True
        try:
            super().connect_to(address)
        finally:
            self._addressed = False

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if self._sock is None and not self._addressed:
            # The connection holds a proxy of its pool, which holds a weak reference to it.
            self.host, self.port = self.connection_pool.connection_pool_ref().primary()
        super().connect_check_health(*args, **kwargs)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["disconnect_on_error"] = True
        try:
            return super().read_response(*args, **kwargs)
        except _REDIRECTIONS as exc:
            self.disconnect()
            raise _moved_away(self.connection_pool.connection_pool_ref(), exc) from exc


class _SyncPrimarySSLConnection(_SyncPrimaryConnection, sync_redis.SSLConnection):
    pass


class FollowingPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool (connections to whichever server is primary, as the sentinels or the
    cluster's nodes name it) with the blocking pool's waiting for a free connection, and no
    command sent to a former primary.

    redis-py asks the sentinels only when it opens a connection, so a pooled connection to a
    primary that was frozen, replaced, then thawed would go on reading and writing there (it
    takes writes until the sentinels demote it, seconds later, and those writes are lost). So,
    at most once per :data:`_PRIMARY_REFRESH_S`, the pool asks where the primary is (waiting
    up to :data:`_PRIMARY_REFRESH_WAIT_S` for the answer, which otherwise lands in the
    background), and a connection to any other server is closed before it is used."""

    _primary: Address | None = None
    _refreshed_at = 0.0
    _refreshing: asyncio.Task[None] | None = None

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now - self._refreshed_at > _PRIMARY_REFRESH_S and (self._refreshing is None or self._refreshing.done()):
            self._refreshed_at = now
            self._refreshing = asyncio.create_task(self._refresh())
            with contextlib.suppress(TimeoutError):  # a sentinel that does not answer holds no command up
                await asyncio.wait_for(asyncio.shield(self._refreshing), _PRIMARY_REFRESH_WAIT_S)
        connection = await super().get_connection(*args, **kwargs)
        moved = self._primary is not None and (connection.host, connection.port) != self._primary
        if moved and connection.is_connected:
            await connection.disconnect()  # the command reconnects, to the primary the sentinels name
        return connection

    async def _refresh(self) -> None:
        with contextlib.suppress(redis_errors.RedisError):
            await self.primary()

    async def primary(self) -> Address:
        """Where the sentinels say the primary is now. Remembered for the connections' check;
        while the sentinels disagree, every pooled connection counts as moved (no sentinel
        answering at all changes nothing: the connections open go on)."""
        try:
            self._primary = await self.sentinel_manager.discover_master(self.service_name)
        except PrimaryInDoubt:
            self._primary = IN_DOUBT
            raise
        return self._primary


class _SyncFollowingPool(sync_sentinel.SentinelConnectionPool):
    """The blocking client's :class:`FollowingPool` (the refresh runs on a thread)."""

    _primary: Address | None = None
    _refreshed_at = 0.0
    _refreshing: threading.Thread | None = None

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now - self._refreshed_at > _PRIMARY_REFRESH_S and (
            self._refreshing is None or not self._refreshing.is_alive()
        ):
            self._refreshed_at = now
            self._refreshing = threading.Thread(target=self._refresh, name="relaylm-sentinel-refresh", daemon=True)
            self._refreshing.start()
            self._refreshing.join(_PRIMARY_REFRESH_WAIT_S)
        connection = super().get_connection(*args, **kwargs)
        moved = self._primary is not None and (connection.host, connection.port) != self._primary
        if moved and getattr(connection, "_sock", None) is not None:
            connection.disconnect()
        return connection

    def _refresh(self) -> None:
        with contextlib.suppress(redis_errors.RedisError):
            self.primary()

    def primary(self) -> Address:
        """As :meth:`FollowingPool.primary`."""
        try:
            self._primary = self.sentinel_manager.discover_master(self.service_name)
        except PrimaryInDoubt:
            self._primary = IN_DOUBT
            raise
        return self._primary


def _timeouts() -> dict[str, float]:
    return {"socket_connect_timeout": _CONNECT_TIMEOUT_S, "socket_timeout": COMMAND_TIMEOUT_S}


def connect_redis(target: RedisTarget) -> Redis:
    """A lazily connecting client: the first command connects, so start-up never blocks on Redis."""
    if not target.is_replicated:
        pool = BlockingConnectionPool.from_url(
            target.url,
            max_connections=MAX_CONNECTIONS,
            timeout=COMMAND_TIMEOUT_S,
            retry=_stale_socket_retry(),
            **_timeouts(),
        )
        return Redis(connection_pool=pool)
    sentinel: Sentinel
    if target.cluster_nodes:
        sentinel = _ClusterSlotOwner(target.cluster_nodes, target.slot, {**target.primary_options, **_timeouts()})
    else:
        sentinel = _AgreedPrimarySentinel(
            list(target.sentinels), sentinel_kwargs=_timeouts(), **target.primary_options, **_timeouts()
        )
    client: Redis = sentinel.master_for(
        target.service,
        redis_class=Redis,
        connection_pool_class=FollowingPool,
        connection_class=_PrimarySSLConnection if target.primary_options.get("ssl") else _PrimaryConnection,
        max_connections=MAX_CONNECTIONS,
        timeout=COMMAND_TIMEOUT_S,
        retry=_stale_socket_retry(),
    )
    return client


def connect_sync_redis(target: RedisTarget, timeout_s: float) -> sync_redis.Redis:
    """A blocking client (for threads outside the event loop), every socket bounded by ``timeout_s``."""
    timeouts = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    retry = SyncRetry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,))
    if not target.is_replicated:
        return sync_redis.Redis.from_url(target.url, retry=retry, **timeouts)
    sentinel: sync_sentinel.Sentinel
    if target.cluster_nodes:
        sentinel = _SyncClusterSlotOwner(target.cluster_nodes, target.slot, {**target.primary_options, **timeouts})
    else:
        sentinel = _AgreedPrimarySyncSentinel(
            list(target.sentinels), sentinel_kwargs=timeouts, **target.primary_options, **timeouts
        )
    tls = target.primary_options.get("ssl", False)
    connection_class = _SyncPrimarySSLConnection if tls else _SyncPrimaryConnection
    client: sync_redis.Redis = sentinel.master_for(
        target.service, connection_pool_class=_SyncFollowingPool, retry=retry, connection_class=connection_class
    )
    return client


async def subscription_follows_primary(redis: Redis, pubsub: PubSub) -> bool:
    """False when Sentinel (or the cluster) names a primary other than the server this
    subscription listens to (always True for one server). Raises RedisError while none is named."""
    pool = redis.connection_pool
    connection = pubsub.connection
    if not isinstance(pool, FollowingPool) or connection is None:
        return True
    primary = await pool.primary()
    return (getattr(connection, "host", None), getattr(connection, "port", None)) == primary


class RedisRefused(RuntimeError):
    """Redis answers but will not take us (wrong password, protected mode): retrying cannot help."""


async def wait_for_redis(redis: Redis, target: RedisTarget, stop: asyncio.Event) -> bool:
    """Until Redis answers a PING: a worker on another host may well start before Redis does.

    False when ``stop`` was set first; ``RedisRefused`` when Redis rejects the connection."""
    delay = 0.25
    while not stop.is_set():
        try:
            await redis.ping()
            return True
        except (redis_errors.AuthenticationError, redis_errors.ResponseError) as exc:
            raise RedisRefused(f"Redis at {target.describe()} refused the connection: {exc}") from exc
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            logger.warning("Redis at %s does not answer (%s); retrying in %.1f s", target.describe(), exc, delay)
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            delay = min(delay * 2, _RETRY_MAX_S)
    return False
