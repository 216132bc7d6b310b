"""Redis for every relaylm process: where it is (``target``), where its primary is (``primary``,
pure), connections that follow that primary through failovers (``following``), and writes that
wait for a replica (``durability``)."""

from shared.redis.durability import NO_REPLICA_ACK, ReplicaAck
from shared.redis.following import (
    COMMAND_TIMEOUT_S,
    MAX_CONNECTIONS,
    RedisRefused,
    connect_redis,
    connect_sync_redis,
    subscription_follows_primary,
    wait_for_redis,
)
from shared.redis.primary import (
    ClusterNode,
    PrimaryInDoubt,
    SentinelState,
    agreed_primary,
    locate_primary,
    parse_cluster_nodes,
    slot_owner,
)
from shared.redis.target import Address, RedisTarget, parse_addresses, redacted

__all__ = [
    "COMMAND_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "NO_REPLICA_ACK",
    "Address",
    "ClusterNode",
    "PrimaryInDoubt",
    "RedisRefused",
    "RedisTarget",
    "ReplicaAck",
    "SentinelState",
    "agreed_primary",
    "connect_redis",
    "connect_sync_redis",
    "locate_primary",
    "parse_addresses",
    "parse_cluster_nodes",
    "redacted",
    "slot_owner",
    "subscription_follows_primary",
    "wait_for_redis",
]
