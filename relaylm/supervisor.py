"""``relaylm serve``: Redis if needed, one worker per model and the API as child processes; a
banner; "ready" per model as each worker is; a child that dies is restarted with its own backoff;
Ctrl-C (or SIGTERM) stops everything this command started, and a second Ctrl-C kills what is
still running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import redis

from api.settings import ApiSettings
from relaylm.redis_launcher import RedisHandle, ensure_redis
from shared.redis import RedisTarget, connect_sync_redis
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
    """One supervised process, the API or the worker for one model: its current process, restart
    bookkeeping and, for a worker, what has been announced of its current process."""

    command: str  # the relaylm subcommand it runs: "api" or "worker"
    model: str | None = None  # a worker's --model
    model_id: str | None = None  # a worker's model as clients name it (its --served-model-name, else --model)
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while it is down, waiting out the backoff
    num_restarts: int = 0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    is_ready_announced: bool = False
    is_compile_announced: bool = False

    @property
    def name(self) -> str:
        """For messages: ``api``, or ``worker for all-minilm-l6-v2``."""
        return self.command if self.model_id is None else f"{self.command} for {self.model_id}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def is_announced(self) -> bool:
        return self.is_ready_announced and self.is_compile_announced


class Supervisor:
    def __init__(
        self, api_settings: ApiSettings, worker_settings: WorkerSettings, models: Sequence[str], given: dict[str, Any]
    ) -> None:
        """``models``: one worker each; ``worker_settings.served_model_name`` renames the only one."""
        self.api_settings = api_settings
        self.worker_settings = worker_settings
        self.given = given  # the flags given (--model aside), passed to every child as RELAYLM_*
        self.redis: RedisHandle | None = None
        self._registry: redis.Redis | None = None
        self.workers = [_Child("worker", model, worker_settings.served_model_name or model) for model in models]
        self.api = _Child("api")
        self.children = [*self.workers, self.api]
        self._env: dict[str, str] = {}
        self._is_spawning = False
        self._is_stop_requested = False
        self._stopping = False

    def run(self) -> int:
        # Explicit handlers: a process started in the background inherits SIGINT as ignored.
        for signum in _STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        try:
            target = self.api_settings.redis_target
            if target.is_replicated:  # Sentinel or Cluster is the operator's to run, never started here
                self.redis = RedisHandle(url=target.url, origin="replicated")
            else:
                self.redis = ensure_redis(target.url)
                target = RedisTarget(self.redis.url)
            self._registry = connect_sync_redis(target, timeout_s=1)
            self._env = _env_for(self.given, self.redis.url)
            for child in self.children:
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
            command = [sys.executable, "-m", "relaylm", child.command]
            env = self._env if child.model is None else {**self._env, "RELAYLM_MODEL": child.model}
            child.popen = subprocess.Popen(command, env=env, process_group=0)
            child.started_at = time.monotonic()
            child.restart_at = None
        finally:
            self._is_spawning = False
        if self._is_stop_requested:
            raise KeyboardInterrupt

    def _print_banner(self) -> None:
        redis = self.redis
        assert redis is not None
        base = self._base_url()
        origin = "already running" if redis.origin == "existing" else f"started here from {redis.origin}"
        where = redis.url
        if redis.origin == "replicated":
            where, origin = self.api_settings.redis_target.describe(), "followed through failovers"
        workers = [f"  Worker  model {child.model_id}  (pid {child.pid}; loading…)" for child in self.workers]
        lines = [
            "",
            "relaylm serve",
            f"  Redis   {where}  ({origin})",
            f"  API     {base}/v1  (pid {self.api.pid})",
            *workers,
            f"  Ready?  curl {base}/ready",
            "  Ctrl-C stops everything started here.",
            "",
        ]
        print("\n".join(lines), flush=True)

    def _base_url(self) -> str:
        return f"http://{self.api_settings.host}:{self.api_settings.port}"

    def _watch(self) -> NoReturn:
        while True:
            now = time.monotonic()
            for child in self.children:
                self._tend(child, now)
            self._announce_when_ready()
            time.sleep(_POLL_S)  # a signal interrupts the sleep: Ctrl-C is never kept waiting

    def _tend(self, child: _Child, now: float) -> None:
        """Schedule a restart for a child that exited; perform it once its backoff has passed."""
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.num_restarts += 1
                self._launch(child)
                child.is_ready_announced = child.is_compile_announced = False  # again for the new process
                print(f"relaylm serve: the {child.name} restarted (pid {child.pid})", flush=True)
            return
        assert child.popen is not None
        code = child.popen.poll()
        if code is None:
            return
        delay_s = child.backoff.next_delay_s(uptime_s=now - child.started_at)
        child.restart_at = now + delay_s
        print(
            f"relaylm serve: the {child.name} exited with {describe_exit(code)}; "
            f"restarting in {delay_s:.1f} s (restart {child.num_restarts + 1})",
            flush=True,
        )

    def _announce_when_ready(self) -> None:
        pending = [child for child in self.workers if not child.is_announced and child.is_running]
        if not pending:
            return
        records = self._registry_records(child.model_id for child in pending if child.model_id is not None)
        for child in pending:
            # Only the current process counts: a killed one's record says "ready" until its TTL runs out.
            mine = (r for r in records if r.model == child.model_id and r.pid == child.pid)
            info = next((r for r in mine if r.state == "ready"), None)
            if info is not None:
                self._announce(child, info)

    def _announce(self, worker: _Child, info: WorkerInfo) -> None:
        if not worker.is_ready_announced:
            worker.is_ready_announced = True
            model = f"'{worker.model_id}' ({info.task})"
            print(f"relaylm serve: ready — model {model} at {self._base_url()}/v1", flush=True)
            if info.compiled_decode == "building":
                print(f"relaylm serve: compiling one stream's decode step of '{worker.model_id}' in the background "
                      "(~1 min at a model's first start; the eager step serves meanwhile)", flush=True)  # fmt: skip
        # Only generate workers have a decode step; the others report "off".
        if not worker.is_compile_announced and info.compiled_decode in ("ready", "failed", "off"):
            worker.is_compile_announced = True
            if info.compiled_decode != "off":
                outcome = "compiled" if info.compiled_decode == "ready" else "not compiled (see the worker's log)"
                print(f"relaylm serve: one stream's decode step of '{worker.model_id}' {outcome}", flush=True)

    def _registry_records(self, model_ids: Iterable[str]) -> list[WorkerInfo]:
        """The registry records of these models' workers, read from Redis directly (polling /ready
        would fill the API's access log); none while Redis does not answer."""
        assert self._registry is not None
        keys = self.worker_settings.keys
        try:
            with self._registry.pipeline(transaction=False) as pipe:
                for model_id in model_ids:
                    pipe.smembers(keys.model_workers(model_id))
                members: list[set[bytes]] = pipe.execute()
            worker_ids = sorted({worker_id.decode() for ids in members for worker_id in ids})
            records = self._registry.mget([keys.worker(w) for w in worker_ids]) if worker_ids else []
        except redis.RedisError:
            return []
        return [WorkerInfo.model_validate_json(raw) for raw in records if raw]

    def _on_signal(self, _signum: int, _frame: object) -> None:
        if self._stopping:
            self._kill_all()
            return
        self._is_stop_requested = True
        if not self._is_spawning:
            raise KeyboardInterrupt

    def _kill_all(self) -> None:
        print("relaylm serve: stopping at once", flush=True)
        for child in self.children:
            if child.is_running:
                assert child.popen is not None
                child.popen.kill()

    def _stop_all(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        running = [child.popen for child in self.children if child.popen is not None and child.is_running]
        for popen in running:
            popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for popen in running:
            try:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        if self._registry is not None:
            self._registry.close()
        if self.redis is not None:
            self.redis.stop()
