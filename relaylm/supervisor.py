"""``relaylm serve``: Redis if needed, one worker and the API as child processes; a banner;
Ctrl-C (or SIGTERM) stops everything this command started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import redis

from api.settings import ApiSettings
from relaylm.redis_launcher import RedisHandle, ensure_redis
from shared.registry import WorkerInfo
from worker.settings import WorkerSettings

_READY_POLL_S = 1.0
_STOP_TIMEOUT_S = 40.0


def _env_for(values: dict[str, Any], redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in values.items():
        env[f"RELAYLM_{name.upper()}"] = str(value)
    env["RELAYLM_REDIS_URL"] = redis_url
    env.pop("REDIS_URL", None)
    return env


class Supervisor:
    def __init__(self, api_settings: ApiSettings, worker_settings: WorkerSettings, given: dict[str, Any]) -> None:
        self.api_settings = api_settings
        self.worker_settings = worker_settings
        self.given = given
        self.redis: RedisHandle | None = None
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self._stopping = False

    def run(self) -> int:
        # Explicit handlers: a process started in the background inherits SIGINT as ignored.
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.redis = ensure_redis(self.api_settings.redis_url)
            env = _env_for(self.given, self.redis.url)
            self.children["worker"] = self._spawn("worker", env)
            self.children["api"] = self._spawn("api", env)
            self._print_banner()
            return self._watch()
        except KeyboardInterrupt:
            return 0
        finally:
            self._stop_all()

    def _spawn(self, role: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "relaylm", role], env=env)

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
                    f"  API     {base}/v1  (pid {self.children['api'].pid})",
                    f"  Worker  model {worker.model_id}  (pid {self.children['worker'].pid}; loading…)",
                    f"  Ready?  curl {base}/ready",
                    "  Ctrl-C stops everything started here.",
                    "",
                ]
            ),
            flush=True,
        )

    def _watch(self) -> int:
        base = f"http://{self.api_settings.host}:{self.api_settings.port}"
        announced = False
        while True:
            for role, child in self.children.items():
                code = child.poll()
                if code is not None:
                    print(f"relaylm serve: the {role} exited with code {code}; stopping", flush=True)
                    return code or 1
            if not announced and self._worker_is_ready():
                announced = True
                print(
                    f"relaylm serve: ready — model '{self.worker_settings.model_id}' at {base}/v1",
                    flush=True,
                )
            time.sleep(_READY_POLL_S)

    def _worker_is_ready(self) -> bool:
        """Read the registry directly (polling /ready would fill the API's access log)."""
        assert self.redis is not None
        keys, model = self.worker_settings.keys, self.worker_settings.model_id
        try:
            client = redis.Redis.from_url(self.redis.url, socket_timeout=1)
            try:
                worker_ids = client.smembers(keys.model_workers(model))
                records = client.mget([keys.worker(w.decode()) for w in worker_ids]) if worker_ids else []
            finally:
                client.close()
        except redis.RedisError:
            return False
        return any(raw and WorkerInfo.model_validate_json(raw).state == "ready" for raw in records)

    def _on_signal(self, _signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    def _stop_all(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for child in self.children.values():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        if self.redis is not None:
            self.redis.stop()
