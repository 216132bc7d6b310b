"""Where Redis is (one server or a Sentinel service), which primary the sentinels agree on, and
the replica wait after writes a failover must not lose (against a real Redis)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.sentinel import MasterNotFoundError

from shared.connection import (
    PrimaryInDoubt,
    RedisTarget,
    ReplicaAck,
    SentinelState,
    agreed_primary,
    connect_redis,
    parse_addresses,
)
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
