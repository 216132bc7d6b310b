"""Where Redis is, as the settings name it: one server, a primary that Sentinel names, or the
primary of a Redis Cluster serving the deployment's slot. Pure: nothing here opens a socket."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from redis.asyncio.connection import parse_url
from redis.crc import key_slot

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


def redacted(url: str) -> str:
    """The URL fit for a log line: never a Redis password."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
