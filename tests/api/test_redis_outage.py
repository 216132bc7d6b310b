"""Riding out Redis not answering: under Sentinel or Cluster a stream waits up to the failover wait,
with one Redis not at all; after Redis answers again (or the subscription moved) the new primary
settles for one worker lease, during which no job is judged for a missed heartbeat."""

from __future__ import annotations

from api.jobs.redis_outage import RedisOutage


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_replicated_redis_is_waited_for_up_to_the_failover_wait() -> None:
    clock = _Clock()
    outage = RedisOutage(failover_wait_s=10.0, lease_s=5.0, clock=clock)
    assert not outage.is_settling
    assert outage.failed() and outage.is_failing and outage.is_settling
    clock.now_s += 9.9
    assert outage.failed()
    clock.now_s += 0.2
    assert not outage.failed()  # 10.1 s without an answer: no failover is coming


def test_each_outage_gets_the_whole_wait() -> None:
    clock = _Clock()
    outage = RedisOutage(failover_wait_s=10.0, lease_s=5.0, clock=clock)
    outage.failed()
    clock.now_s += 8
    outage.answered()
    clock.now_s += 60
    assert outage.failed()
    clock.now_s += 8
    assert outage.failed()


def test_with_one_redis_nothing_is_waited_for() -> None:
    outage = RedisOutage(failover_wait_s=0.0, clock=_Clock())
    assert not outage.failed()
    assert outage.is_failing


def test_the_new_primary_settles_for_a_lease_after_redis_answers_again() -> None:
    clock = _Clock()
    outage = RedisOutage(failover_wait_s=10.0, lease_s=5.0, clock=clock)
    outage.answered()  # no outage: nothing to settle
    assert not outage.is_settling
    outage.failed()
    clock.now_s += 3
    outage.answered()
    assert not outage.is_failing and outage.is_settling
    clock.now_s += 4.9
    assert outage.is_settling
    clock.now_s += 0.2
    assert not outage.is_settling


def test_a_moved_subscription_settles_for_a_lease_too() -> None:
    clock = _Clock()
    outage = RedisOutage(failover_wait_s=0.0, lease_s=5.0, clock=clock)
    outage.moved()
    assert outage.is_settling and not outage.is_failing
    clock.now_s += 5.1
    assert not outage.is_settling
