"""Real API and worker processes on loopback, each run as ``python -m relaylm ...``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import redis

from shared.redis_keys import RedisKeys
from shared.registry import WorkerInfo

# A worker's start includes its deterministic self-test: ~4 s for the default model on the exact
# kernels' AVX-512 VNNI code, ~32 s on 2 cores of an AVX2-only CPU (their AVX2 code), more under load.
START_TIMEOUT_S = 300.0
# How long a test waits for something the stack does on its own (a heartbeat, a requeue, a log
# line): generous, since waiting ends as soon as it happens, and a loaded host is slow.
SETTLE_TIMEOUT_S = 30.0


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Poll ``condition`` until it holds; past ``timeout_s`` fail saying ``what`` never happened."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Process:
    role: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def is_running(self) -> bool:
        return self.popen.poll() is None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The process stopped (SIGSTOP) for the block, then continued: what a worker runs stays
        unfinished meanwhile, however fast the CPU. Its heartbeat outlives a pause shorter than
        the heartbeat TTL (5 s)."""
        self.popen.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.popen.send_signal(signal.SIGCONT)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


@dataclass
class Stack:
    """One deployment (its own key prefix) on a shared test Redis."""

    redis_url: str
    log_dir: Path
    key_prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    # Redis Cluster nodes (host:port,...): then the processes follow the primary serving the
    # prefix's hash tag, and ``redis_url`` is where the test's own reads go.
    cluster_nodes: str | None = None
    api: Process | None = None
    workers: list[Process] = field(default_factory=list)
    port: int = 0

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys.in_cluster(self.key_prefix) if self.cluster_nodes else RedisKeys(self.key_prefix)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **settings: object) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("REDIS_URL", None)
        env.update({"RELAYLM_REDIS_URL": self.redis_url, "RELAYLM_KEY_PREFIX": self.key_prefix})
        if self.cluster_nodes:
            env["RELAYLM_REDIS_CLUSTER_NODES"] = self.cluster_nodes
        env.update({f"RELAYLM_{name.upper()}": str(value) for name, value in settings.items()})
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, role: str, name: str, settings: dict[str, object], prefix: tuple[str, ...] = ()) -> Process:
        log_path = self.log_dir / f"{self.key_prefix}-{name}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [*prefix, sys.executable, "-m", "relaylm", role],
                env=self.env(**settings),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return Process(role, popen, log_path)

    def start_api(self, **settings: object) -> Process:
        self.port = self.port or free_port()
        self.api = self._spawn("api", "api", {"port": self.port, **settings})
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.api.is_running():
                raise RuntimeError(f"API exited:\n{self.api.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return self.api
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"API did not start:\n{self.api.log()}")

    def start_worker(
        self,
        model: str | Path,
        served_model_name: str,
        wait: bool = True,
        command_prefix: tuple[str, ...] = (),
        **settings: object,
    ) -> Process:
        """``command_prefix``: e.g. ``("ip", "netns", "exec", "host2")`` to run it on another test host."""
        name = f"worker{len(self.workers)}"
        settings = {
            "model": model,
            "served_model_name": served_model_name,
            "worker_id": f"{self.key_prefix}-{name}",
            **settings,
        }
        settings.setdefault("heartbeat_interval_s", 0.5)
        process = self._spawn("worker", name, settings, command_prefix)
        self.workers.append(process)
        if wait:
            self.wait_ready(process, served_model_name)
        return process

    def wait_ready(self, process: Process, model: str) -> None:
        worker_id = f"{self.key_prefix}-worker{self.workers.index(process)}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not process.is_running():
                raise RuntimeError(f"worker exited:\n{process.log()}")
            info = self.worker_info(worker_id)
            if info is not None and info.state == "ready":
                return
            time.sleep(0.1)
        raise TimeoutError(f"worker did not become ready:\n{process.log()}")

    def worker_info(self, worker_id: str) -> WorkerInfo | None:
        client = redis.Redis.from_url(self.redis_url)
        try:
            raw = client.get(self.keys.worker(worker_id))
        finally:
            client.close()
        return WorkerInfo.model_validate_json(raw) if raw else None

    def job_owner(self, job_id: str) -> str | None:
        """The worker id that runs the job now (None while it is queued or after it ended)."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            owner = client.hget(self.keys.job(job_id), "owner")
        finally:
            client.close()
        return owner.decode() if owner else None

    def job_state(self, job_id: str) -> str | None:
        """The job's lifecycle state (queued, running, finished, failed, cancelled, expired)."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            state = client.hget(self.keys.job(job_id), "state")
        finally:
            client.close()
        return state.decode() if state else None

    def running_jobs(self) -> dict[str, str]:
        """Job id → owner (worker id) of every job in the running set."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            job_ids = [raw.decode() for raw in client.zrange(self.keys.running_jobs(), 0, -1)]
            owners = [client.hget(self.keys.job(job_id), "owner") for job_id in job_ids]
        finally:
            client.close()
        return {job_id: owner.decode() for job_id, owner in zip(job_ids, owners, strict=True) if owner}

    def worker_of(self, job_id: str) -> Process:
        """The worker process that runs the job now."""
        owner = self.job_owner(job_id)
        return next(w for i, w in enumerate(self.workers) if owner == f"{self.key_prefix}-worker{i}")

    def metric(self, name: str) -> float:
        """The sum of a Prometheus series' samples in the API's ``/metrics`` (every label set)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
        return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))

    def client(self, **kwargs: object) -> openai.OpenAI:
        options: dict[str, object] = {"max_retries": 0, **kwargs}
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", **options)  # type: ignore[arg-type]

    def stop(self) -> None:
        for process in [*self.workers, *([self.api] if self.api else [])]:
            process.stop(signal.SIGKILL if not process.is_running() else signal.SIGTERM, timeout_s=15)
