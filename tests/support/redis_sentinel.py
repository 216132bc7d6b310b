"""A replicated Redis on loopback for failover tests: one primary, one replica and three
sentinels (``redis-server <conf> --sentinel``), each a real process the test can kill or freeze."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.stack import free_port

SERVICE = "relaylm-test"
# Quick to notice a dead primary (production uses tens of seconds): the tests time a failover.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 4000
_START_TIMEOUT_S = 15.0


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def role(self) -> str:
        client = self.client()
        try:
            return str(client.info("replication")["role"])
        finally:
            client.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a frozen one must be able to die
            self.process.kill()
            self.process.wait()


@dataclass
class SentinelGroup:
    workdir: Path
    binary: str
    servers: list[Server] = field(default_factory=list)  # the primary first, then the replica
    sentinels: list[Server] = field(default_factory=list)

    @property
    def sentinel_addresses(self) -> str:
        return ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)

    @property
    def url(self) -> str:
        """For ``--redis-url``: the database only (the sentinels name the server)."""
        return "redis://127.0.0.1/0"

    def primary_port(self) -> int | None:
        """The primary the sentinels name now (None while none names one)."""
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                address = client.sentinel_get_master_addr_by_name(SERVICE)
            except redis.RedisError:
                continue
            finally:
                client.close()
            if address:
                return int(address[1])
        return None

    def server(self, port: int) -> Server:
        return next(s for s in self.servers if s.port == port)

    def primary(self) -> Server:
        port = self.primary_port()
        assert port is not None, "no sentinel names a primary"
        return self.server(port)

    def wait_promotion(self, old_port: int, timeout_s: float = 30.0) -> float:
        """Until the sentinels name another primary, and it says it is one; returns the moment."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port is not None and port != old_port:
                try:
                    if self.server(port).role() == "master":
                        return time.monotonic()
                except redis.RedisError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"no replica was promoted within {timeout_s} s")

    def wait_replica_of(self, server: Server, primary_port: int, timeout_s: float = 30.0) -> None:
        wait_replica_of(server, primary_port, timeout_s)

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def wait_replica_of(server: Server, primary_port: int, timeout_s: float = 30.0) -> None:
    """Until ``server`` replicates ``primary_port`` with its link up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        client = server.client()
        try:
            info = client.info("replication")
            following = info.get("role") == "slave" and int(info.get("master_port", 0)) == primary_port
            if following and info.get("master_link_status") == "up":
                return
        except redis.RedisError:
            pass
        finally:
            client.close()
        time.sleep(0.1)
    raise TimeoutError(f"{server.name} did not become a replica of port {primary_port}")


def _answering(port: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=0.2, socket_connect_timeout=0.2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def start_server(binary: str, workdir: Path, name: str, args: list[str], port: int) -> Server:
    log = workdir / f"{name}.log"
    process = subprocess.Popen(
        [binary, *args, "--logfile", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    server = Server(name, port, process)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _answering(port):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{name} did not start:\n{log.read_text() if log.exists() else ''}")
        time.sleep(0.05)
    return server


def start_sentinel_group(binary: str) -> SentinelGroup:
    group = SentinelGroup(Path(tempfile.mkdtemp(prefix="relaylm-sentinel-")), binary)
    try:
        for index, name in enumerate(("primary", "replica")):
            port = free_port()
            data = group.workdir / name
            data.mkdir()
            args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(data)]
            if index == 1:
                args += ["--replicaof", "127.0.0.1", str(group.servers[0].port)]
            group.servers.append(start_server(binary, group.workdir, name, args, port))
        primary, replica = group.servers
        group.wait_replica_of(replica, primary.port)
        for index in range(3):
            port = free_port()
            conf = group.workdir / f"sentinel{index}.conf"  # sentinels rewrite their own config
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {group.workdir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            sentinel = start_server(binary, group.workdir, f"sentinel{index}", [str(conf), "--sentinel"], port)
            group.sentinels.append(sentinel)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while group.primary_port() != primary.port or not _sentinels_see_the_replica(group):
            if time.monotonic() > deadline:
                raise TimeoutError("the sentinels did not agree on the primary and its replica")
            time.sleep(0.1)
    except BaseException:
        group.stop()
        raise
    return group


def _sentinels_see_the_replica(group: SentinelGroup) -> bool:
    for sentinel in group.sentinels:
        client = sentinel.client()
        try:
            if not client.sentinel_slaves(SERVICE) or len(client.sentinel_sentinels(SERVICE)) < 2:
                return False
        except redis.RedisError:
            return False
        finally:
            client.close()
    return True
