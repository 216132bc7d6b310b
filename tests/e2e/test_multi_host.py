"""Nothing assumes one host: a worker in its own network namespace (its own loopback, its own
address) reaches Redis over a veth link and serves requests that the API on the first host takes."""

from __future__ import annotations

import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from relaylm.redis_launcher import find_redis_server, start_redis
from tests.conftest import make_stack
from tests.support.stack import free_port

pytestmark = pytest.mark.slow


@dataclass
class RemoteHost:
    namespace: str
    address: str  # the namespace's side of the link
    gateway: str  # this host's side, where Redis listens


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def second_host() -> Iterator[RemoteHost]:
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to make a network namespace")
    suffix = f"{random.randrange(1 << 16):04x}"
    namespace, outside, inside = f"rl-{suffix}", f"rl{suffix}a", f"rl{suffix}b"
    subnet = random.randrange(1, 250)
    host = RemoteHost(namespace, f"10.213.{subnet}.2", f"10.213.{subnet}.1")
    try:
        _ip("netns", "add", namespace)
    except (subprocess.CalledProcessError, PermissionError) as exc:
        pytest.skip(f"cannot create a network namespace here (needs root): {exc}")
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("addr", "add", f"{host.gateway}/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("netns", "exec", namespace, "ip", "addr", "add", f"{host.address}/30", "dev", inside)
        _ip("netns", "exec", namespace, "ip", "link", "set", inside, "up")
        _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        yield host
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def test_a_worker_on_another_host_serves_through_the_shared_redis(
    second_host: RemoteHost, log_dir: Path, tiny_model_path: Path
) -> None:
    binary = find_redis_server()
    assert binary is not None
    port = free_port()
    server = start_redis(binary, port=port)  # on loopback for the API ...
    try:
        # ... and on the link for the other host. Off loopback Redis refuses clients that have no
        # password (protected mode), so the deployment the README describes sets one.
        password = secrets.token_hex(8)
        admin = redis.Redis.from_url(server.url)
        admin.config_set("bind", f"127.0.0.1 {second_host.gateway}")
        admin.config_set("requirepass", password)
        admin.close()
        stack = make_stack(f"redis://:{password}@127.0.0.1:{port}/0", log_dir)
        try:
            stack.start_api()
            stack.start_worker(
                tiny_model_path, "remote-tiny", dtype="float32", max_model_len=256,
                command_prefix=("ip", "netns", "exec", second_host.namespace),
                redis_url=f"redis://:{password}@{second_host.gateway}:{port}/0",
            )  # fmt: skip
            reply = stack.client().chat.completions.create(
                model="remote-tiny", messages=[{"role": "user", "content": "hello from host one"}], max_tokens=3
            )
            assert reply.choices[0].finish_reason in ("stop", "length")
            worker = stack.workers[0]
            assert f"job={reply.id}" in worker.log()
            info = stack.worker_info(f"{stack.key_prefix}-worker0")
            assert info is not None and info.state == "ready"
        finally:
            stack.stop()
    finally:
        server.stop()
