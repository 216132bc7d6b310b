"""``relaylm serve``: Redis if needed, one worker and the API as child processes; a banner;
a child that dies is restarted with backoff; Ctrl-C (or SIGTERM) stops everything this command
started, and a second Ctrl-C kills what is still running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

import redis

from api.settings import ApiSettings
from relaylm.redis_launcher import RedisHandle, ensure_redis
from shared.registry import WorkerInfo
from worker.settings import WorkerSettings

_POLL_S = 0.5
_STOP_TIMEOUT_S = 40.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _env_for(values: dict[str, Any], redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in values.items():
        env[f"RELAYLM_{name.upper()}"] = str(value)
    env["RELAYLM_REDIS_URL"] = redis_url
    env.pop("REDIS_URL", None)
    return env


def describe_exit(code: int) -> str:
    """``code 1``, or ``code -9 (killed by SIGKILL)``: Popen reports death by a signal as its negative."""
    if code >= 0:
        return f"code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"code {code} (killed by {name})"


@dataclass
class RestartBackoff:
    """Delays before restarting a child that keeps dying: 1, 2, 4 … 30 s. A child that stayed up
    ``stable_after_s`` died of something new, so its next restart waits ``first_s`` again."""

    first_s: float = 1.0
    max_s: float = 30.0
    stable_after_s: float = 60.0
    _next_s: float = field(default=0.0, init=False)

    def next_delay_s(self, uptime_s: float) -> float:
        if self._next_s == 0.0 or uptime_s >= self.stable_after_s:
            self._next_s = self.first_s
        delay_s = self._next_s
        self._next_s = min(delay_s * 2, self.max_s)
        return delay_s


@dataclass
class _Child:
    """One supervised role (``worker`` or ``api``): its current process and restart bookkeeping."""

    role: str
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while it is down, waiting out the backoff
    num_restarts: int = 0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)

    @property
    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Supervisor:
    def __init__(self, api_settings: ApiSettings, worker_settings: WorkerSettings, given: dict[str, Any]) -> None:
        self.api_settings = api_settings
        self.worker_settings = worker_settings
        self.given = given
        self.redis: RedisHandle | None = None
        self.children = {role: _Child(role) for role in ("worker", "api")}
        self._env: dict[str, str] = {}
        self._is_announced = False
        self._is_compile_announced = False
        self._is_spawning = False
        self._is_stop_requested = False
        self._stopping = False

    def run(self) -> int:
        # Explicit handlers: a process started in the background inherits SIGINT as ignored.
        for signum in _STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        try:
            self.redis = ensure_redis(self.api_settings.redis_url)
            self._env = _env_for(self.given, self.redis.url)
            for child in self.children.values():
                self._launch(child)
            self._print_banner()
            self._watch()
        except KeyboardInterrupt:
            return 0
        finally:
            self._stop_all()

    def _launch(self, child: _Child) -> None:
        """Start (or restart) ``child``. A stop signal that arrives meanwhile is held until the new
        process is recorded, so the stop that follows reaches it and nothing is orphaned."""
        self._is_spawning = True
        try:
            # Its own process group: a terminal's Ctrl-C reaches only this supervisor, which sends
            # each child one SIGTERM (a second signal makes the API quit without draining).
            command = [sys.executable, "-m", "relaylm", child.role]
            child.popen = subprocess.Popen(command, env=self._env, process_group=0)
            child.started_at = time.monotonic()
            child.restart_at = None
        finally:
            self._is_spawning = False
        if self._is_stop_requested:
            raise KeyboardInterrupt

    def _print_banner(self) -> None:
        api, worker, redis = self.api_settings, self.worker_settings, self.redis
        assert redis is not None
        base = f"http://{api.host}:{api.port}"
        origin = "already running" if redis.origin == "existing" else f"started here from {redis.origin}"
        print(
            "\n".join(
                [
                    "",
                    "relaylm serve",
                    f"  Redis   {redis.url}  ({origin})",
                    f"  API     {base}/v1  (pid {self._pid('api')})",
                    f"  Worker  model {worker.model_id}  (pid {self._pid('worker')}; loading…)",
                    f"  Ready?  curl {base}/ready",
                    "  Ctrl-C stops everything started here.",
                    "",
                ]
            ),
            flush=True,
        )

    def _pid(self, role: str) -> int | None:
        popen = self.children[role].popen
        return popen.pid if popen is not None else None

    def _watch(self) -> NoReturn:
        while True:
            now = time.monotonic()
            for child in self.children.values():
                self._tend(child, now)
            self._announce_when_ready()
            time.sleep(_POLL_S)  # a signal interrupts the sleep: Ctrl-C is never kept waiting

    def _tend(self, child: _Child, now: float) -> None:
        """Schedule a restart for a child that exited; perform it once its backoff has passed."""
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.num_restarts += 1
                self._launch(child)
                if child.role == "worker":
                    self._is_announced = self._is_compile_announced = False  # again for the new worker
                print(f"relaylm serve: the {child.role} restarted (pid {self._pid(child.role)})", flush=True)
            return
        assert child.popen is not None
        code = child.popen.poll()
        if code is None:
            return
        delay_s = child.backoff.next_delay_s(uptime_s=now - child.started_at)
        child.restart_at = now + delay_s
        print(
            f"relaylm serve: the {child.role} exited with {describe_exit(code)}; "
            f"restarting in {delay_s:.1f} s (restart {child.num_restarts + 1})",
            flush=True,
        )

    def _announce_when_ready(self) -> None:
        if self._is_announced and self._is_compile_announced:
            return
        info = self._ready_worker()
        if info is None:
            return
        if not self._is_announced:
            self._is_announced = True
            base = f"http://{self.api_settings.host}:{self.api_settings.port}"
            print(f"relaylm serve: ready — model '{self.worker_settings.model_id}' at {base}/v1", flush=True)
            if info.compiled_decode == "building":
                print("relaylm serve: compiling one stream's decode step in the background "
                      "(~1 min at a model's first start; the eager step serves meanwhile)", flush=True)  # fmt: skip
        if not self._is_compile_announced and info.compiled_decode in ("ready", "failed", "off"):
            self._is_compile_announced = True
            if info.compiled_decode != "off":
                outcome = "compiled" if info.compiled_decode == "ready" else "not compiled (see the worker's log)"
                print(f"relaylm serve: one stream's decode step {outcome}", flush=True)

    def _ready_worker(self) -> WorkerInfo | None:
        """The current worker's registry record once it is ready. Read from the registry directly
        (polling /ready would fill the API's access log). Only the current worker counts: a killed
        one's record says "ready" until its TTL runs out."""
        assert self.redis is not None
        worker = self.children["worker"]
        if not worker.is_running:
            return None
        keys, model = self.worker_settings.keys, self.worker_settings.model_id
        try:
            client = redis.Redis.from_url(self.redis.url, socket_timeout=1)
            try:
                worker_ids = client.smembers(keys.model_workers(model))
                records = client.mget([keys.worker(w.decode()) for w in worker_ids]) if worker_ids else []
            finally:
                client.close()
        except redis.RedisError:
            return None
        infos = [WorkerInfo.model_validate_json(raw) for raw in records if raw]
        return next((i for i in infos if i.state == "ready" and i.pid == self._pid("worker")), None)

    def _on_signal(self, _signum: int, _frame: object) -> None:
        if self._stopping:
            self._kill_all()
            return
        self._is_stop_requested = True
        if not self._is_spawning:
            raise KeyboardInterrupt

    def _kill_all(self) -> None:
        print("relaylm serve: stopping at once", flush=True)
        for child in self.children.values():
            if child.is_running:
                assert child.popen is not None
                child.popen.kill()

    def _stop_all(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        running = [child.popen for child in self.children.values() if child.popen is not None and child.is_running]
        for popen in running:
            popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for popen in running:
            try:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        if self.redis is not None:
            self.redis.stop()
