"""Real workers held in their loading state for as long as a test needs, however fast the CPU.

A worker registers as loading before it loads its model. Each held worker is stopped (SIGSTOP) at
once and then let run in short slices until its registry record says ``loading``: it can have
gone at most one slice further, and no model loads in one. It stays stopped for the block, its
registry record kept from expiring meanwhile, as its own heartbeats keep it while its model loads
(they run beside the load); then it goes on (SIGCONT) and becomes ready on its own."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from shared.redis_keys import WORKER_HEARTBEAT_TTL_S
from shared.registry import WorkerInfo
from tests.support.stack import Process, Stack

STEP_S = 0.05  # one slice of a stepped worker's run: far less than any model takes to load
_REGISTER_TIMEOUT_S = 300.0  # Python and torch starting on a loaded host


def worker_id_of(stack: Stack, process: Process) -> str:
    return f"{stack.key_prefix}-worker{stack.workers.index(process)}"


def _state(client: redis.Redis, key: str) -> str | None:
    raw = client.get(key)
    return WorkerInfo.model_validate_json(raw).state if raw else None


def _signal(processes: list[Process], signum: int) -> None:
    for process in processes:
        process.popen.send_signal(signum)


@contextmanager
def held_in_loading(stack: Stack, processes: list[Process]) -> Iterator[None]:
    """``processes``: workers just started (``wait=False``), not yet registered."""
    client = redis.Redis.from_url(stack.redis_url)
    keys = [stack.keys.worker(worker_id_of(stack, process)) for process in processes]
    _signal(processes, signal.SIGSTOP)
    keeping = threading.Event()
    keeper = threading.Thread(target=_keep_registered, args=(stack.redis_url, keys, keeping), daemon=True)
    keeper.start()  # a worker that registered waits stopped while the others are stepped on
    try:
        _step_until_registered(client, processes, keys)
        yield
    finally:
        keeping.set()
        keeper.join()
        _signal(processes, signal.SIGCONT)
        client.close()


def _step_until_registered(client: redis.Redis, processes: list[Process], keys: list[str]) -> None:
    deadline = time.monotonic() + _REGISTER_TIMEOUT_S
    pending = list(zip(processes, keys, strict=True))
    while pending:
        for process, _ in pending:
            assert process.is_running(), f"worker exited:\n{process.log()}"
        assert time.monotonic() < deadline, "workers did not register"
        running = [process for process, _ in pending]
        _signal(running, signal.SIGCONT)
        time.sleep(STEP_S)
        _signal(running, signal.SIGSTOP)
        still = []
        for process, key in pending:
            state = _state(client, key)
            assert state in (None, "loading"), f"the worker was {state} before it could be held:\n{process.log()}"
            if state is None:
                still.append((process, key))
        pending = still


def _keep_registered(redis_url: str, keys: list[str], stop: threading.Event) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        while not stop.wait(1.0):
            for key in keys:
                client.expire(key, WORKER_HEARTBEAT_TTL_S)
    finally:
        client.close()
