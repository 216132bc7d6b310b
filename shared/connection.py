"""The one way every process connects to Redis: every command has a timeout, so a frozen Redis
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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis as sync_redis
import redis.sentinel as sync_sentinel
from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import Pipeline, PubSub
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry as SyncRetry

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


Address = tuple[str, int]


@dataclass(frozen=True)
class RedisTarget:
    """Where Redis is: the server at ``url``; with ``sentinels``, the primary those sentinels
    name for ``service``; with ``cluster_nodes``, the cluster primary serving the slot of
    ``{hash_tag}`` (with either, ``url`` gives only the credentials, the database and TLS)."""

    url: str
    sentinels: tuple[Address, ...] = ()
    service: str = "mymaster"
    cluster_nodes: tuple[Address, ...] = ()
    hash_tag: str = "relaylm"

    @property
    def is_replicated(self) -> bool:
        """Whether a failover can replace the primary (and lose its last unreplicated writes)."""
        return bool(self.sentinels or self.cluster_nodes)

    @property
    def slot(self) -> int:
        """The cluster slot of ``{hash_tag}``: every key and channel of the deployment's."""
        return key_slot(self.hash_tag.encode())

    def describe(self) -> str:
        """For a log line: never a password."""
        if self.cluster_nodes:
            nodes = ",".join(f"{host}:{port}" for host, port in self.cluster_nodes)
            return f"Redis Cluster via {nodes} (hash tag {{{self.hash_tag}}}, slot {self.slot})"
        if not self.sentinels:
            return redacted(self.url)
        nodes = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"Sentinel service {self.service!r} via {nodes} (db {self.primary_options.get('db', 0)})"

    @functools.cached_property
    def primary_options(self) -> dict[str, Any]:
        """The URL's credentials, database and TLS, for connections to whichever server is primary."""
        options: dict[str, Any] = dict(parse_url(self.url))
        kept = {name: options[name] for name in ("username", "password", "db") if options.get(name) is not None}
        if self.url.startswith("rediss://"):
            kept["ssl"] = True
        return kept


def parse_addresses(text: str) -> tuple[Address, ...]:
    """``host:port[,host:port...]`` (an IPv6 host in brackets) as (host, port) pairs."""
    addresses = []
    for item in text.split(","):
        item = item.strip()
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not host:port")
        addresses.append((host.strip("[]"), int(port)))
    if not addresses:
        raise ValueError("no host:port given")
    return tuple(addresses)


SentinelState = dict[str, Any]


class PrimaryInDoubt(MasterNotFoundError):
    """Sentinels answer but do not agree on the primary: a failover is under way."""


# A pool's remembered primary while the sentinels disagree: no pooled connection is used.
_IN_DOUBT: Address = ("", 0)


def agreed_primary(
    answers: list[SentinelState | None], service: str, is_healthy: Callable[[SentinelState], bool]
) -> Address:
    """The primary a majority of the sentinels name, under the newest configuration epoch any of
    them reports. ``answers``: each configured sentinel's view of ``service`` (None: it did not
    answer, or does not know the service).

    The first sentinel's word is not enough: during a failover, and for a moment after, a
    sentinel that has not heard of it still names the old primary, which, frozen and thawed,
    takes writes until the sentinels demote it (those writes are then lost). A newer epoch
    anywhere means the majority's view is out of date; so does no majority at all. Either way
    this raises (a connection error: callers retry) until the sentinels agree."""
    known = [state for state in answers if state]
    if not known:
        raise MasterNotFoundError(f"no sentinel names a primary for {service!r}")
    newest = max(_epoch(state) for state in known)
    votes = Counter(
        (str(state["ip"]), int(state["port"])) for state in known if _epoch(state) == newest and is_healthy(state)
    )
    if votes:
        address, count = votes.most_common(1)[0]
        if count > len(answers) // 2:
            return address
    raise PrimaryInDoubt(f"the sentinels do not agree on a primary for {service!r} yet (a failover under way?)")


def _epoch(state: SentinelState) -> int:
    return int(state.get("config-epoch", 0))


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


@dataclass(frozen=True)
class ClusterNode:
    """One line of ``CLUSTER NODES``: a node as one node of the cluster sees it."""

    address: Address
    is_primary: bool
    failed: bool  # the cluster agreed it is down ("fail"; a lone suspicion, "fail?", is not enough)
    config_epoch: int
    slots: tuple[tuple[int, int], ...]

    def serves(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


def parse_cluster_nodes(text: str) -> list[ClusterNode]:
    """``CLUSTER NODES``: ``id host:port@bus[,hostname] flags primary-id ping pong epoch link slots...``
    (a slot being migrated, ``[slot->-id]``, is left out: it is served where it still is)."""
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        host, _, port = fields[1].split("@")[0].rpartition(":")
        flags = set(fields[2].split(","))
        if not host or not port.isdigit() or flags & {"noaddr", "handshake"}:
            continue
        slots = []
        for item in fields[8:]:
            if not item.startswith("["):
                low, _, high = item.partition("-")
                slots.append((int(low), int(high or low)))
        nodes.append(ClusterNode((host, int(port)), "master" in flags, "fail" in flags, int(fields[6]), tuple(slots)))
    return nodes


def slot_owner(views: list[list[ClusterNode]], slot: int) -> Address:
    """The primary serving ``slot``, by the newest configuration epoch any node reports: during a
    failover, and for a moment after, a node that has not heard of it still names the old
    primary (which, frozen and thawed, thinks itself primary until it hears of the new epoch).
    Raises (a connection error: callers retry) while no node names a live primary for it."""
    claims = [
        (node.config_epoch, node.address)
        for view in views
        for node in view
        if node.is_primary and not node.failed and node.serves(slot)
    ]
    if not claims:
        raise MasterNotFoundError(f"no cluster node names a live primary for slot {slot}")
    return max(claims)[1]


def _cluster_nodes_text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _newly_named(views: list[list[ClusterNode]], known: set[Address]) -> list[Address]:
    """The nodes the views name that were not known yet (now they are): asked from now on, so
    that the nodes given at start may all go without losing the cluster."""
    new = sorted({node.address for view in views for node in view} - known)
    known.update(new)
    return new


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
                return parse_cluster_nodes(_cluster_nodes_text(await node.execute_command("CLUSTER", "NODES")))
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                return None

        views = [view for view in await asyncio.gather(*(ask(node) for node in self.sentinels)) if view is not None]
        for host, port in _newly_named(views, self._known):
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
                views.append(parse_cluster_nodes(_cluster_nodes_text(node.execute_command("CLUSTER", "NODES"))))
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                continue
        for host, port in _newly_named(views, self._known):
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


class _FollowingPool(SentinelConnectionPool, BlockingConnectionPool):
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
            self._primary = _IN_DOUBT
            raise
        return self._primary


class _SyncFollowingPool(sync_sentinel.SentinelConnectionPool):
    """The blocking client's :class:`_FollowingPool` (the refresh runs on a thread)."""

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
        """As :meth:`_FollowingPool.primary`."""
        try:
            self._primary = self.sentinel_manager.discover_master(self.service_name)
        except PrimaryInDoubt:
            self._primary = _IN_DOUBT
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
        connection_pool_class=_FollowingPool,
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
    if not isinstance(pool, _FollowingPool) or connection is None:
        return True
    primary = await pool.primary()
    return (getattr(connection, "host", None), getattr(connection, "port", None)) == primary


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
        if not isinstance(pool, _FollowingPool):
            return
        await pool.primary()  # the pool's connections to any other server are closed before use
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
NO_REPLICA_ACK = ReplicaAck(0)


def redacted(url: str) -> str:
    """The URL fit for a log line: never a Redis password."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


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
