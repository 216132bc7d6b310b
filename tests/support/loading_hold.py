"""Real workers held in their loading state for as long as a test needs, however fast the CPU.

A worker registers as loading before it loads its model. Each held worker is stopped (SIGSTOP) at
once and then let run in short slices until its registry record says ``loading`` and its log says
it has started loading (its start-up Redis reads done: none is left in flight to time out while it
is stopped): it can have gone at most one slice further, and no model loads in one. It stays stopped for the block, its
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


def _is_loading(client: redis.Redis, key: str, process: Process, worker_id: str) -> bool:
    state = _state(client, key)
    assert state in (None, "loading"), f"the worker was {state} before it could be held:\n{process.log()}"
    return state == "loading" and f"worker {worker_id} registered for model" in process.log()


def _signal(processes: list[Process], signum: int) -> None:
    for process in processes:
        process.popen.send_signal(signum)


@contextmanager
def held_in_loading(stack: Stack, processes: list[Process]) -> Iterator[None]:
    """``processes``: workers just started (``wait=False``), not yet registered."""
    client = redis.Redis.from_url(stack.redis_url)
    worker_ids = [worker_id_of(stack, process) for process in processes]
    keys = [stack.keys.worker(worker_id) for worker_id in worker_ids]
    _signal(processes, signal.SIGSTOP)
    keeping = threading.Event()
    keeper = threading.Thread(target=_keep_registered, args=(stack.redis_url, keys, keeping), daemon=True)
    keeper.start()  # a worker that registered waits stopped while the others are stepped on
    try:
        _step_until_loading(client, list(zip(processes, keys, worker_ids, strict=True)))
        yield
    finally:
        keeping.set()
        keeper.join()
        _signal(processes, signal.SIGCONT)
        client.close()


def _step_until_loading(client: redis.Redis, pending: list[tuple[Process, str, str]]) -> None:
    """``pending``: each worker's process, registry key and id."""
    deadline = time.monotonic() + _REGISTER_TIMEOUT_S
    while pending:
        for process, _, _ in pending:
            assert process.is_running(), f"worker exited:\n{process.log()}"
        assert time.monotonic() < deadline, "workers did not start loading"
        running = [process for process, _, _ in pending]
        _signal(running, signal.SIGCONT)
        time.sleep(STEP_S)
        _signal(running, signal.SIGSTOP)
        pending = [(p, key, worker_id) for p, key, worker_id in pending if not _is_loading(client, key, p, worker_id)]


def _keep_registered(redis_url: str, keys: list[str], stop: threading.Event) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        while not stop.wait(1.0):
            for key in keys:
                client.expire(key, WORKER_HEARTBEAT_TTL_S)
    finally:
        client.close()
