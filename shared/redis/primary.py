"""Where the primary is, decided from what the sentinels or the cluster's nodes answered: one
pure function per kind of deployment, and ``locate_primary`` over all three. Nothing here opens a
socket; ``following.py`` asks the servers and hands their answers here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import MasterNotFoundError

from shared.redis.target import Address, RedisTarget

SentinelState = dict[str, Any]


class PrimaryInDoubt(MasterNotFoundError):
    """Sentinels answer but do not agree on the primary: a failover is under way."""


# A pool's remembered primary while the sentinels disagree: no pooled connection is used.
IN_DOUBT: Address = ("", 0)


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


def cluster_nodes_text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def newly_named(views: list[list[ClusterNode]], known: set[Address]) -> list[Address]:
    """The nodes the views name that were not known yet (now they are): asked from now on, so
    that the nodes given at start may all go without losing the cluster."""
    new = sorted({node.address for view in views for node in view} - known)
    known.update(new)
    return new


def locate_primary(
    target: RedisTarget,
    sentinel_answers: list[SentinelState | None] | None = None,
    cluster_views: list[list[ClusterNode]] | None = None,
    is_healthy: Callable[[SentinelState], bool] = lambda state: True,
) -> Address:
    """The primary of ``target``: the URL's server; the one a majority of the sentinels name
    (``sentinel_answers``, one per configured sentinel); or the node serving the deployment's
    slot (``cluster_views``, one per node that answered ``CLUSTER NODES``)."""
    if target.cluster_nodes:
        return slot_owner(cluster_views or [], target.slot)
    if target.sentinels:
        return agreed_primary(sentinel_answers or [None] * len(target.sentinels), target.service, is_healthy)
    options: dict[str, Any] = dict(parse_url(target.url))
    return str(options.get("host", "localhost")), int(options.get("port", 6379))
