"""Where Redis is (one server, a Sentinel service or a Redis Cluster), which primary the sentinels
agree on, which node serves the cluster slot, and the replica wait after writes a failover must
not lose (against a real Redis)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.sentinel import MasterNotFoundError

from shared.job_lifecycle import JobLifecycle
from shared.redis import (
    ClusterNode,
    PrimaryInDoubt,
    RedisTarget,
    ReplicaAck,
    SentinelState,
    agreed_primary,
    connect_redis,
    locate_primary,
    parse_addresses,
    parse_cluster_nodes,
    slot_owner,
)
from shared.redis_keys import RedisKeys
from shared.settings import CommonSettings


def _state(port: int, epoch: int = 0, flags: str = "master") -> SentinelState:
    return {"ip": "10.0.0.1", "port": port, "config-epoch": epoch, "flags": flags}


def _healthy(state: SentinelState) -> bool:
    return "s_down" not in state["flags"] and "o_down" not in state["flags"]


def test_sentinel_addresses_parse_and_bad_ones_name_the_item() -> None:
    assert parse_addresses("a:26379, 10.0.0.2:26380,[::1]:5000") == (
        ("a", 26379), ("10.0.0.2", 26380), ("::1", 5000),
    )  # fmt: skip
    for bad in ("", "host", "host:", ":26379", "host:0", "host:70000", "host:port"):
        with pytest.raises(ValueError):
            parse_addresses(bad)


def test_settings_select_sentinel_from_flags_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RELAYLM_REDIS_URL", "REDIS_URL", "RELAYLM_REDIS_SENTINELS", "RELAYLM_REDIS_SENTINEL_SERVICE"):
        monkeypatch.delenv(name, raising=False)
    assert CommonSettings().redis_target == RedisTarget("redis://127.0.0.1:6379/0")
    assert not CommonSettings().redis_target.is_replicated
    monkeypatch.setenv("RELAYLM_REDIS_SENTINELS", "s1:26379,s2:26379")
    monkeypatch.setenv("RELAYLM_REDIS_SENTINEL_SERVICE", "cache")
    monkeypatch.setenv("RELAYLM_REDIS_URL", "redis://:secret@ignored:1/3")
    target = CommonSettings().redis_target
    assert target.sentinels == (("s1", 26379), ("s2", 26379)) and target.service == "cache"
    assert target.is_replicated
    assert "secret" not in target.describe() and "db 3" in target.describe()
    monkeypatch.setenv("RELAYLM_REDIS_SENTINELS", "s1")
    with pytest.raises(ValueError, match="host:port"):
        CommonSettings()


def test_settings_select_a_cluster_with_the_prefix_as_hash_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RELAYLM_REDIS_URL", "REDIS_URL", "RELAYLM_REDIS_SENTINELS", "RELAYLM_KEY_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELAYLM_REDIS_CLUSTER_NODES", "n1:7000,n2:7001")
    monkeypatch.setenv("RELAYLM_KEY_PREFIX", "prod")
    settings = CommonSettings()
    target = settings.redis_target
    assert target.cluster_nodes == (("n1", 7000), ("n2", 7001)) and target.is_replicated
    assert target.hash_tag == "prod" and "{prod}" in target.describe() and str(target.slot) in target.describe()
    assert settings.keys == RedisKeys("{prod}", sharded_channels=True)
    assert settings.keys.job("x") == "{prod}:job:x" and settings.keys.publish_command == "SPUBLISH"
    monkeypatch.setenv("RELAYLM_REDIS_URL", "redis://:pw@unused/2")
    with pytest.raises(ValueError, match="only database 0"):
        CommonSettings()
    monkeypatch.setenv("RELAYLM_REDIS_URL", "redis://:pw@unused/0")
    monkeypatch.setenv("RELAYLM_REDIS_SENTINELS", "s1:26379")
    with pytest.raises(ValueError, match="not both"):
        CommonSettings()


def test_lifecycle_scripts_publish_on_shard_channels_in_a_cluster(redis_url: str) -> None:
    """The scripts' text: SPUBLISH for a cluster deployment, PUBLISH otherwise (never both)."""
    redis = connect_redis(RedisTarget(redis_url))
    sharded = JobLifecycle(redis, RedisKeys.in_cluster("t"))
    plain = JobLifecycle(redis, RedisKeys("t"))
    for script in ("_create", "_claim", "_requeue", "_end"):
        sharded_text = getattr(sharded, script).script
        plain_text = getattr(plain, script).script
        assert "'PUBLISH'" not in sharded_text and "'SPUBLISH'" not in plain_text
        assert sharded_text.replace("'SPUBLISH'", "'PUBLISH'") == plain_text


_NODES = """\
07c3 127.0.0.1:30004@31004 slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f 127.0.0.1:30003@31003 master - 0 1426238318243 3 connected 10923-16383 [42->-67ed]
e7d1 127.0.0.1:30001@31001,host1 myself,master - 0 0 1 connected 0-5460
aaaa :0@0 noaddr,master - 0 0 0 disconnected
"""


def test_cluster_nodes_parse_with_their_slots_and_flags() -> None:
    nodes = parse_cluster_nodes(_NODES)
    assert [node.address for node in nodes] == [
        ("127.0.0.1", 30004), ("127.0.0.1", 30002), ("127.0.0.1", 30003), ("127.0.0.1", 30001),
    ]  # fmt: skip
    assert [node.is_primary for node in nodes] == [False, True, True, True]
    assert nodes[2].slots == ((10923, 16383),) and nodes[3].config_epoch == 1
    assert slot_owner([nodes], 0) == ("127.0.0.1", 30001) and slot_owner([nodes], 16383) == ("127.0.0.1", 30003)


def test_the_slot_owner_is_the_newest_epochs_live_primary() -> None:
    old = ClusterNode(("10.0.0.1", 7000), True, False, 1, ((0, 100),))
    promoted = ClusterNode(("10.0.0.2", 7000), True, False, 7, ((0, 100),))
    # A node that has not heard of the failover (the old primary, thawed) names the old one.
    assert slot_owner([[old], [promoted], [old]], 50) == ("10.0.0.2", 7000)
    failed = ClusterNode(("10.0.0.1", 7000), True, True, 1, ((0, 100),))
    demoted = ClusterNode(("10.0.0.1", 7000), False, False, 1, ())
    with pytest.raises(MasterNotFoundError):
        slot_owner([[failed, demoted], []], 50)
    with pytest.raises(MasterNotFoundError):
        slot_owner([[promoted]], 101)


_CLUSTER_VIEW = st.builds(
    ClusterNode,
    st.tuples(st.just("10.0.0.1"), st.integers(7000, 7003)),
    st.booleans(),
    st.booleans(),
    st.integers(0, 5),
    st.lists(st.tuples(st.integers(0, 50), st.integers(50, 100)), max_size=2).map(tuple),
)


@given(st.lists(st.lists(_CLUSTER_VIEW, max_size=4), max_size=4), st.integers(0, 100))
def test_a_slot_owner_serves_the_slot_and_no_view_knows_a_newer_live_claim(
    views: list[list[ClusterNode]], slot: int
) -> None:
    claims = [n for view in views for n in view if n.is_primary and not n.failed and n.serves(slot)]
    try:
        address = slot_owner(views, slot)
    except MasterNotFoundError:
        assert claims == []
        return
    newest = max(n.config_epoch for n in claims)
    assert any(n.address == address and n.config_epoch == newest for n in claims)


def test_the_majority_at_the_newest_epoch_names_the_primary() -> None:
    assert agreed_primary([_state(1), _state(1), None], "svc", _healthy) == ("10.0.0.1", 1)
    # One sentinel saw the failover (epoch 1); two still name the old primary: in doubt.
    with pytest.raises(PrimaryInDoubt):
        agreed_primary([_state(2, 1), _state(1), _state(1)], "svc", _healthy)
    # Two saw it: the new primary, whatever the third says.
    assert agreed_primary([_state(2, 1), _state(2, 1), _state(1)], "svc", _healthy) == ("10.0.0.1", 2)
    # The old primary marked down and no new one yet: in doubt, never the first answer.
    with pytest.raises(PrimaryInDoubt):
        agreed_primary([_state(1, flags="master,s_down"), _state(1), None], "svc", _healthy)
    with pytest.raises(MasterNotFoundError):
        agreed_primary([None, None, None], "svc", _healthy)


_FLAGS = st.sampled_from(["master", "master,s_down"])


@given(st.lists(st.none() | st.builds(_state, st.integers(1, 3), st.integers(0, 2), _FLAGS), min_size=1, max_size=5))
def test_an_agreed_primary_is_named_by_a_majority_and_no_sentinel_knows_a_newer_epoch(
    answers: list[SentinelState | None],
) -> None:
    try:
        address = agreed_primary(answers, "svc", _healthy)
    except MasterNotFoundError:
        return
    known = [a for a in answers if a]
    newest = max(int(a["config-epoch"]) for a in known)
    votes = [a for a in known if (a["ip"], a["port"]) == address and _healthy(a) and a["config-epoch"] == newest]
    assert len(votes) > len(answers) // 2


def test_a_replica_wait_without_a_replica_accepts_the_write_and_counts_it(redis_url: str) -> None:
    unacknowledged: list[int] = []

    async def scenario() -> list[object]:
        redis = connect_redis(RedisTarget(redis_url))
        try:
            ack = ReplicaAck(50, "relaylm-test:replica-ack", lambda: unacknowledged.append(1))
            written = await ack.write(redis, "a test job", lambda pipe: pipe.set("relaylm-test:acked", 1))
            await ack.confirm(redis, "a test batch")
            none_waits = await ReplicaAck(0).write(redis, "x", lambda pipe: pipe.get("relaylm-test:acked"))
            return [*written, *none_waits]
        finally:
            await redis.aclose()

    assert asyncio.run(scenario()) == [True, b"1"]
    assert len(unacknowledged) == 2  # the test Redis has no replica: both waits timed out


def test_the_primary_is_located_from_the_answers_alone() -> None:
    """One pure function for the three deployments: no socket, only what the servers answered."""
    single = RedisTarget("redis://10.0.0.5:6380/2")
    assert locate_primary(single) == ("10.0.0.5", 6380)
    sentinels = RedisTarget("redis://x/0", sentinels=(("s1", 26379), ("s2", 26379), ("s3", 26379)))
    old = {"ip": "10.0.0.1", "port": 6379, "config-epoch": 1}
    new = {"ip": "10.0.0.2", "port": 6379, "config-epoch": 2}
    assert locate_primary(sentinels, sentinel_answers=[new, new, old]) == ("10.0.0.2", 6379)
    with pytest.raises(PrimaryInDoubt):
        locate_primary(sentinels, sentinel_answers=[new, None, old])
    with pytest.raises(MasterNotFoundError):
        locate_primary(sentinels)
    cluster = RedisTarget("redis://x/0", cluster_nodes=(("n1", 7000),))
    slot = cluster.slot
    stale = ClusterNode(("n1", 7000), True, False, 1, ((0, 16383),))
    promoted = ClusterNode(("n2", 7001), True, False, 3, ((slot, slot),))
    assert locate_primary(cluster, cluster_views=[[stale], [stale, promoted]]) == ("n2", 7001)
