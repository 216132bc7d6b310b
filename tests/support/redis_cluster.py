"""A Redis Cluster on loopback for the tests: three primaries, each with one replica, every one a
real ``redis-server --cluster-enabled yes`` process the test can kill or freeze. Built with
CLUSTER ADDSLOTSRANGE / MEET / REPLICATE, so it needs no redis-cli."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from tests.support.redis_sentinel import Server, start_server, wait_replica_of
from tests.support.stack import free_port

# Quick to notice a dead primary (production uses seconds to tens of seconds): the tests time a failover.
NODE_TIMEOUT_MS = 1000
_SLOTS = 16384
_START_TIMEOUT_S = 30.0


@dataclass
class ClusterNodes:
    workdir: Path
    binary: str
    servers: list[Server] = field(default_factory=list)  # three primaries, then their replicas in order

    @property
    def addresses(self) -> str:
        """For ``--redis-cluster-nodes``: every node (a client needs only one that answers)."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def owner(self, hash_tag: str) -> Server:
        """The primary serving the slot of ``{hash_tag}`` now: of the nodes that say they are
        primaries serving it, the one with the newest configuration epoch."""
        slot = key_slot(hash_tag.encode())
        claims = []
        for server in self.servers:
            myself = _myself(server)
            if myself is not None and "master" in myself[2] and _covers(myself[8:], slot):
                claims.append((int(myself[6]), server))
        assert claims, f"no node serves slot {slot}"
        return max(claims, key=lambda claim: claim[0])[1]

    def server(self, port: int) -> Server:
        return next(s for s in self.servers if s.port == port)

    @staticmethod
    def serves_at_start(primary_index: int, hash_tag: str) -> bool:
        """Whether the ``primary_index``-th primary was given the slot of ``{hash_tag}`` (the
        slots are split in three even ranges at start)."""
        low, high = _slot_range(primary_index)
        return low <= key_slot(hash_tag.encode()) <= high

    def role(self, server: Server) -> str:
        try:
            return server.role()
        except redis.RedisError:
            return "down"

    def wait_promotion(self, old: Server, timeout_s: float = 30.0) -> Server:
        """Until old's replica says it is a primary and the cluster serves every slot again."""
        replica = self.replica_of(old)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.role(replica) == "master" and _cluster_ok(replica):
                return replica
            time.sleep(0.05)
        raise TimeoutError(f"no replica of port {old.port} was promoted within {timeout_s} s")

    def replica_of(self, primary: Server) -> Server:
        index = self.servers.index(primary)
        return self.servers[index + 3] if index < 3 else self.servers[index - 3]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class ClusterShard:
    """The shard serving one hash tag's slot, as the failover tests see a replicated primary."""

    cluster: ClusterNodes
    hash_tag: str

    def primary(self) -> Server:
        return self.cluster.owner(self.hash_tag)

    def wait_promotion(self, old_port: int, timeout_s: float = 30.0) -> float:
        """Until the old primary's replica serves the slot and the cluster is whole again; the moment."""
        self.cluster.wait_promotion(self.cluster.server(old_port), timeout_s)
        return time.monotonic()

    def wait_replica_of(self, server: Server, primary_port: int, timeout_s: float = 30.0) -> None:
        wait_replica_of(server, primary_port, timeout_s)


def _slot_range(primary_index: int) -> tuple[int, int]:
    return primary_index * _SLOTS // 3, (primary_index + 1) * _SLOTS // 3 - 1


def _myself(server: Server) -> list[str] | None:
    """The node's own line of CLUSTER NODES, split (None when it does not answer)."""
    for line in _nodes_text(server).splitlines():
        fields = line.split()
        if "myself" in fields[2]:
            return fields
    return None


def _nodes_text(server: Server) -> str:
    reply = _ask(server, "CLUSTER", "NODES")
    return reply.decode() if isinstance(reply, bytes) else ""


def _covers(ranges: list[str], slot: int) -> bool:
    for item in ranges:
        if not item.startswith("["):
            lo, _, hi = item.partition("-")
            if int(lo) <= slot <= int(hi or lo):
                return True
    return False


def _ask(server: Server, *command: object, quiet: bool = True) -> Any:
    """The server's reply; None when it does not answer (unless not ``quiet``)."""
    client = server.client()
    try:
        return client.execute_command(*command)
    except redis.RedisError:
        if not quiet:
            raise
        return None
    finally:
        client.close()


def _cluster_ok(server: Server) -> bool:
    return b"cluster_state:ok" in (_ask(server, "CLUSTER", "INFO") or b"")


def start_cluster(binary: str) -> ClusterNodes:
    cluster = ClusterNodes(Path(tempfile.mkdtemp(prefix="relaylm-cluster-")), binary)
    try:
        bus_ports: dict[int, int] = {}
        for index in range(6):
            port, bus_ports[index] = free_port(), free_port()
            data = cluster.workdir / f"node{index}"
            data.mkdir()
            args = [
                "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(data),
                "--cluster-enabled", "yes", "--cluster-port", str(bus_ports[index]),
                "--cluster-config-file", str(data / "nodes.conf"), "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--repl-diskless-sync-delay", "0",
            ]  # fmt: skip
            cluster.servers.append(start_server(binary, cluster.workdir, f"node{index}", args, port))
        first = cluster.servers[0].client()
        try:
            for index, server in enumerate(cluster.servers[:3]):
                _ask(server, "CLUSTER", "ADDSLOTSRANGE", *_slot_range(index), quiet=False)
            for index, server in enumerate(cluster.servers[1:], start=1):
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", server.port, bus_ports[index])
        finally:
            first.close()
        _wait(lambda: all(_knows_all(s, 6) for s in cluster.servers), "the nodes did not meet")
        for primary, replica in zip(cluster.servers[:3], cluster.servers[3:], strict=True):
            primary_id = _ask(primary, "CLUSTER", "MYID", quiet=False).decode()
            _ask(replica, "CLUSTER", "REPLICATE", primary_id, quiet=False)
        _wait(lambda: all(_cluster_ok(s) for s in cluster.servers), "the cluster did not come up")
        _wait(lambda: all(_replica_linked(s) for s in cluster.servers[3:]), "the replicas did not sync")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _knows_all(server: Server, count: int) -> bool:
    lines = _nodes_text(server).splitlines()
    return sum(1 for line in lines if "handshake" not in line and line.strip()) == count


def _replica_linked(server: Server) -> bool:
    info = _ask(server, "INFO", "replication") or {}
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)
