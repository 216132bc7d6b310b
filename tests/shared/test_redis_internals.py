"""The redis-py internals ``shared/redis/following.py`` overrides or reads, as this release was
written against them: a redis-py whose signatures or attributes differ fails here, by name,
before any failover test could fail in a way that hides why."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio.sentinel as async_sentinel
import redis.sentinel as sync_sentinel
from redis.asyncio import BlockingConnectionPool

from shared.redis import RedisTarget, connect_redis, connect_sync_redis
from shared.redis.following import FollowingPool

Parameters = list[tuple[str, str]]

# Each overridden or called internal, and its parameters (name, kind) in redis-py 8.1.
OVERRIDDEN: dict[str, tuple[Callable[..., Any], Parameters]] = {
    "asyncio SentinelManagedConnection.connect_to": (
        async_sentinel.SentinelManagedConnection.connect_to,
        [("self", "POSITIONAL_OR_KEYWORD"), ("address", "POSITIONAL_OR_KEYWORD")],
    ),
    "asyncio SentinelManagedConnection.connect_check_health": (
        async_sentinel.SentinelManagedConnection.connect_check_health,
        [("self", "POSITIONAL_OR_KEYWORD"), ("check_health", "POSITIONAL_OR_KEYWORD"),
         ("retry_socket_connect", "POSITIONAL_OR_KEYWORD")],
    ),
    "asyncio SentinelManagedConnection.read_response": (
        async_sentinel.SentinelManagedConnection.read_response,
        [("self", "POSITIONAL_OR_KEYWORD"), ("disable_decoding", "POSITIONAL_OR_KEYWORD"),
         ("timeout", "POSITIONAL_OR_KEYWORD"), ("disconnect_on_error", "KEYWORD_ONLY"),
         ("push_request", "KEYWORD_ONLY")],
    ),
    "asyncio SentinelConnectionPool.get_connection": (
        async_sentinel.SentinelConnectionPool.get_connection,
        [("self", "POSITIONAL_OR_KEYWORD"), ("command_name", "POSITIONAL_OR_KEYWORD"), ("keys", "VAR_POSITIONAL"),
         ("options", "VAR_KEYWORD")],
    ),
    "asyncio BlockingConnectionPool.get_connection": (
        BlockingConnectionPool.get_connection,
        [("self", "POSITIONAL_OR_KEYWORD"), ("command_name", "POSITIONAL_OR_KEYWORD"), ("keys", "VAR_POSITIONAL"),
         ("options", "VAR_KEYWORD")],
    ),
    "asyncio Sentinel.discover_master": (
        async_sentinel.Sentinel.discover_master,
        [("self", "POSITIONAL_OR_KEYWORD"), ("service_name", "POSITIONAL_OR_KEYWORD")],
    ),
    "asyncio Sentinel.check_master_state": (
        async_sentinel.Sentinel.check_master_state,
        [("self", "POSITIONAL_OR_KEYWORD"), ("state", "POSITIONAL_OR_KEYWORD"),
         ("service_name", "POSITIONAL_OR_KEYWORD")],
    ),
    "blocking SentinelManagedConnection.connect_to": (
        sync_sentinel.SentinelManagedConnection.connect_to,
        [("self", "POSITIONAL_OR_KEYWORD"), ("address", "POSITIONAL_OR_KEYWORD")],
    ),
    "blocking SentinelManagedConnection.connect_check_health": (
        sync_sentinel.SentinelManagedConnection.connect_check_health,
        [("self", "POSITIONAL_OR_KEYWORD"), ("check_health", "POSITIONAL_OR_KEYWORD"),
         ("retry_socket_connect", "POSITIONAL_OR_KEYWORD")],
    ),
    "blocking SentinelManagedConnection.read_response": (
        sync_sentinel.SentinelManagedConnection.read_response,
        [("self", "POSITIONAL_OR_KEYWORD"), ("disable_decoding", "POSITIONAL_OR_KEYWORD"),
         ("timeout", "KEYWORD_ONLY"), ("disconnect_on_error", "KEYWORD_ONLY"), ("push_request", "KEYWORD_ONLY")],
    ),
    "blocking SentinelConnectionPool.get_connection": (
        sync_sentinel.SentinelConnectionPool.get_connection,
        [("self", "POSITIONAL_OR_KEYWORD"), ("command_name", "POSITIONAL_OR_KEYWORD"), ("keys", "VAR_POSITIONAL"),
         ("options", "VAR_KEYWORD")],
    ),
    "blocking Sentinel.discover_master": (
        sync_sentinel.Sentinel.discover_master,
        [("self", "POSITIONAL_OR_KEYWORD"), ("service_name", "POSITIONAL_OR_KEYWORD")],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_an_overridden_internal_keeps_its_signature(name: str) -> None:
    function, expected = OVERRIDDEN[name]
    parameters = [(p.name, p.kind.name) for p in inspect.signature(function).parameters.values()]
    assert parameters == expected, f"redis-py changed {name}: review shared/redis/following.py"


SENTINELS = RedisTarget("redis://127.0.0.1:1/0", sentinels=(("127.0.0.1", 1),))
CLUSTER = RedisTarget("redis://127.0.0.1:1/0", cluster_nodes=(("127.0.0.1", 1),))


@pytest.mark.parametrize("target", [SENTINELS, CLUSTER], ids=["sentinel", "cluster"])
def test_the_attributes_the_followers_read_are_where_they_were(target: RedisTarget) -> None:
    """Built without connecting: the clients are lazy, so nothing here needs a server."""
    client = connect_redis(target)
    pool = client.connection_pool
    assert isinstance(pool, FollowingPool)
    assert pool.service_name == target.service and pool.sentinel_manager.sentinels
    assert isinstance(pool.sentinel_manager.sentinel_kwargs, dict)
    connection = pool.make_connection()
    # A weak proxy of the pool: what the connection asks for the primary when it reconnects.
    assert connection.connection_pool.primary == pool.primary and connection.is_connected is False

    blocking = connect_sync_redis(target, 1.0)
    sync_pool = blocking.connection_pool
    assert sync_pool.service_name == target.service and sync_pool.sentinel_manager.sentinels
    sync_connection = sync_pool.make_connection()
    assert sync_connection._sock is None
    assert sync_connection.connection_pool.connection_pool_ref() is sync_pool
