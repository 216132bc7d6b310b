"""The fair share in the claim against a real Redis: which tenant's job a claim takes, and what
service counts (``shared.fair_share``)."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from shared.events import DeltaEvent, encode_event
from shared.fair_share import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST, read_shares
from shared.job_lifecycle import AppendRequest, Claim, EventAppender, JobLifecycle, JobState, ShareOf
from shared.redis_keys import RedisKeys


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[tuple[JobLifecycle, EventAppender, RedisKeys, Redis]]:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:8]}")
    client = Redis.from_url(redis_url)
    sync_client = sync_redis.Redis.from_url(redis_url)
    try:
        yield JobLifecycle(client, keys), EventAppender(sync_client, keys), keys, client
    finally:
        await client.aclose()
        sync_client.close()


async def _queue(lifecycle: JobLifecycle, keys: RedisKeys, job_id: str, share: ShareOf, prompt: int = 100) -> None:
    await lifecycle.create(job_id, b"{}", "m", keys.queue("m"), prefill_tokens=prompt, share=share)


async def _claim(lifecycle: JobLifecycle, keys: RedisKeys, worker: str = "w1") -> Claim:
    claim = await lifecycle.claim(keys.queue("m"), worker, "i1")
    assert isinstance(claim, Claim)
    return claim


async def _claimed_ids(lifecycle: JobLifecycle, keys: RedisKeys, count: int, worker: str = "w1") -> list[str]:
    return [(await _claim(lifecycle, keys, worker)).job_id for _ in range(count)]


async def test_one_tenants_flood_does_not_hold_back_anothers_job(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, _ = env
    for i in range(20):
        await _queue(lifecycle, keys, f"a{i:02d}", ShareOf("A"))
    assert (await _claim(lifecycle, keys)).job_id == "a00"
    await _queue(lifecycle, keys, "b0", ShareOf("B"))
    # B joins level with A (no banked credit, no debt): the tie goes to A's older job, then B's.
    assert await _claimed_ids(lifecycle, keys, 2) == ["a01", "b0"]
    assert await _claimed_ids(lifecycle, keys, 3) == ["a02", "a03", "a04"]


async def test_equal_tenants_alternate_and_a_weight_of_three_gets_three_times_the_jobs(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, _ = env
    for i in range(40):
        await _queue(lifecycle, keys, f"a{i:02d}", ShareOf("A", weight=3.0))
        await _queue(lifecycle, keys, f"b{i:02d}", ShareOf("B"))
        await _queue(lifecycle, keys, f"c{i:02d}", ShareOf("C"))
    taken = Counter(job_id[0] for job_id in await _claimed_ids(lifecycle, keys, 50))
    assert taken["a"] == 30 and taken["b"] == 10 and taken["c"] == 10


async def test_output_tokens_count_twice_a_prompt_token_and_the_bigger_eater_waits(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, appender, keys, redis = env
    await _queue(lifecycle, keys, "a0", ShareOf("A"), prompt=10)
    await _queue(lifecycle, keys, "b0", ShareOf("B"), prompt=10)
    assert await _claimed_ids(lifecycle, keys, 2) == ["a0", "b0"]
    for i in range(1, 4):
        await _queue(lifecycle, keys, f"a{i}", ShareOf("A"), prompt=10)
        await _queue(lifecycle, keys, f"b{i}", ShareOf("B"), prompt=10)
    # While both wait, A's running job writes 50 output tokens and B's 5.
    for job_id, tokens in (("a0", 50), ("b0", 5)):
        record = await lifecycle.record(job_id)
        assert record is not None
        delta = encode_event(DeltaEvent(seq=0, token_ids=list(range(tokens))))
        appender.append([AppendRequest(job_id, record.epoch, [(0, delta)], None, num_tokens=tokens)])
    shares = {share.tenant: share for share in await read_shares(redis, keys.queue("m"))}
    assert shares["A"].served_tokens == 60 and shares["B"].served_tokens == 15
    assert shares["A"].lead == 2 * 45 and shares["B"].rank == 0
    # A: 10 + 2*50 = 110; B: 10 + 2*5 = 20, then 30, 40, 50: B's three go before A's next.
    assert await _claimed_ids(lifecycle, keys, 4) == ["b1", "b2", "b3", "a1"]
    assert (PROMPT_TOKEN_COST, OUTPUT_TOKEN_COST) == (1, 2)


async def test_a_tenant_back_from_idle_gets_no_burst_from_credit_it_did_not_use(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, _ = env
    await _queue(lifecycle, keys, "b-first", ShareOf("B"))
    assert (await _claim(lifecycle, keys)).job_id == "b-first"
    # A alone for a while: B, idle, falls behind by ten jobs' service.
    for i in range(10):
        await _queue(lifecycle, keys, f"a{i}", ShareOf("A"))
    assert len(await _claimed_ids(lifecycle, keys, 5)) == 5
    for i in range(10, 20):
        await _queue(lifecycle, keys, f"a{i}", ShareOf("A"))
    for i in range(6):
        await _queue(lifecycle, keys, f"b{i}", ShareOf("B"))
    # B returns lifted to A's level: the two alternate instead of B taking six in a row.
    order = "".join(job_id[0] for job_id in await _claimed_ids(lifecycle, keys, 8))
    assert "bbb" not in order and order.count("b") == 4


async def test_priority_orders_a_tenants_own_jobs_and_breaks_ties_between_tenants(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, _ = env
    await _queue(lifecycle, keys, "a-normal", ShareOf("A"))
    await _queue(lifecycle, keys, "a-urgent", ShareOf("A", priority=-5))
    await _queue(lifecycle, keys, "a-late", ShareOf("A", priority=5))
    await _queue(lifecycle, keys, "b-urgent", ShareOf("B", priority=-10))
    # Level tenants: B's more urgent head goes first; A's jobs in priority order after it.
    assert await _claimed_ids(lifecycle, keys, 4) == ["b-urgent", "a-urgent", "a-normal", "a-late"]


async def test_a_priority_does_not_buy_a_share_unless_the_key_may_rank_across_tenants(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, _ = env
    for i in range(4):
        await _queue(lifecycle, keys, f"b{i}", ShareOf("B"))
    await _queue(lifecycle, keys, "a-big", ShareOf("A"), prompt=300)
    assert await _claimed_ids(lifecycle, keys, 3) == ["b0", "a-big", "b1"]
    # A (300) is ahead of B (200), which kept waiting: A's urgent job waits for B's share.
    await _queue(lifecycle, keys, "a-pushy", ShareOf("A", priority=-100))
    assert await _claimed_ids(lifecycle, keys, 2) == ["b2", "a-pushy"]
    # A key the admin lets rank across tenants goes first, whatever its share.
    await _queue(lifecycle, keys, "a-ranked", ShareOf("A", priority=-100, band=-100))
    assert await _claimed_ids(lifecycle, keys, 2) == ["a-ranked", "b3"]


async def test_a_job_handed_back_goes_before_every_tenants_queue(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, redis = env
    await _queue(lifecycle, keys, "a0", ShareOf("A"))
    running = await _claim(lifecycle, keys)
    for i in range(3):
        await _queue(lifecycle, keys, f"b{i}", ShareOf("B"))
    assert await lifecycle.requeue("a0", running.epoch)
    again = await _claim(lifecycle, keys, "w2")
    assert (again.job_id, again.attempt) == ("a0", 2)
    shares = {share.tenant: share for share in await read_shares(redis, keys.queue("m"))}
    assert shares["A"].served_tokens == 100  # its prompt is charged once, not per attempt
    assert shares["B"].queued == 3 and shares["B"].rank == 0


async def test_a_cancelled_job_leaves_its_tenants_queue_and_an_idle_tenant_leaves_the_backlog(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, redis = env
    await _queue(lifecycle, keys, "a0", ShareOf("A"))
    await _queue(lifecycle, keys, "b0", ShareOf("B"))
    await lifecycle.cancel(["a0"])
    assert [share.tenant for share in await read_shares(redis, keys.queue("m")) if share.rank is not None] == ["B"]
    assert (await _claim(lifecycle, keys)).job_id == "b0"
    assert await lifecycle.claim(keys.queue("m"), "w1", "i1") is None
    assert not await redis.exists(f"{keys.queue('m')}:tenant:A", f"{keys.queue('m')}:tenant:B")
    assert await redis.zcard(f"{keys.queue('m')}:backlog") == 0


async def test_a_job_an_older_api_queued_without_a_tenant_is_still_claimed(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, redis = env
    queue = keys.queue("m")
    # What an API of the release before the fair share writes: the job's hash and its queue entry.
    await redis.hset(keys.job("old"), mapping={"state": "queued", "queue": queue, "epoch": 0, "attempts": 0,
                                                  "next_seq": 0, "request": b"{}", "model": "m"})  # fmt: skip
    await redis.zadd(queue, {"old": 1})
    await _queue(lifecycle, keys, "new", ShareOf("A"))
    assert await _claimed_ids(lifecycle, keys, 2) == ["new", "old"]
    record = await lifecycle.record("old")
    assert record is not None and record.state is JobState.RUNNING


async def test_two_workers_claiming_in_turn_keep_one_fair_order(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, _ = env
    for i in range(10):
        await _queue(lifecycle, keys, f"a{i}", ShareOf("A"))
    for i in range(5):
        await _queue(lifecycle, keys, f"b{i}", ShareOf("B"))
    order = [(await _claim(lifecycle, keys, f"w{n % 2}")).job_id[0] for n in range(10)]
    assert order == list("ababababab")


async def test_idle_tenants_below_the_floor_are_forgotten(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, redis = env
    for tenant in range(20):
        await _queue(lifecycle, keys, f"t{tenant}", ShareOf(f"T{tenant}"), prompt=1)
    await _claimed_ids(lifecycle, keys, 20)
    for i in range(3):
        await _queue(lifecycle, keys, f"z{i}", ShareOf("Z"), prompt=1)
    await _claimed_ids(lifecycle, keys, 3)
    # The floor passed every idle tenant's counter: only the last to be served is still counted.
    assert await redis.zcard(f"{keys.queue('m')}:service") <= 2


async def test_a_tenant_forgotten_while_its_job_ran_is_charged_from_the_floor(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, appender, keys, redis = env
    queue = keys.queue("m")
    await _queue(lifecycle, keys, "t0", ShareOf("T"), prompt=10)
    long_job = await _claim(lifecycle, keys)
    for i in range(4):
        await _queue(lifecycle, keys, f"a{i}", ShareOf("A"))
        await _queue(lifecycle, keys, f"b{i}", ShareOf("B"))
    await _claimed_ids(lifecycle, keys, 6)  # the floor passes T's 10: T, idle, is forgotten
    assert await redis.zscore(f"{queue}:service", "T") is None
    floor = float(await redis.hget(f"{queue}:fair", "floor"))
    delta = encode_event(DeltaEvent(seq=0, token_ids=list(range(50))))
    appender.append([AppendRequest(long_job.job_id, long_job.epoch, [(0, delta)], None, num_tokens=50)])
    assert await redis.zscore(f"{queue}:service", "T") == floor + 2 * 50


async def test_a_slot_kept_for_quiet_keys_takes_only_a_job_of_a_key_with_nothing_running(env) -> None:  # type: ignore[no-untyped-def]
    lifecycle, _, keys, _ = env
    queue = keys.queue("m")
    for i in range(3):
        await _queue(lifecycle, keys, f"a{i}", ShareOf("A"))
    assert (await _claim(lifecycle, keys)).job_id == "a0"
    assert await lifecycle.claim(queue, "w1", "i1", only_idle_tenants=True) is None  # A has a job running
    await _queue(lifecycle, keys, "b0", ShareOf("B"))
    await _queue(lifecycle, keys, "b1", ShareOf("B"))
    quiet = await lifecycle.claim(queue, "w1", "i1", only_idle_tenants=True)
    assert isinstance(quiet, Claim) and quiet.job_id == "b0"
    assert await lifecycle.claim(queue, "w1", "i1", only_idle_tenants=True) is None  # now B has one running
    assert await _claimed_ids(lifecycle, keys, 3) == ["a1", "a2", "b1"]  # B paid for its quiet job
