"""How soon a new worker takes load: from ``relaylm worker`` starting to its first claimed job, on
the default model.

A request is queued before the worker starts (a first worker of the model holds it, paused, so
the API accepts it), and the new worker's milestones are read from the registry and the job's
record: registered (its process is up and heard from Redis), ready (model loaded, self-test
passed), first job claimed, first token. Three starts, each a new process with a cache
directory of the bench's own:

- ``cold``: an empty cache: the model is fetched from its package and converted, and the
  deterministic self-test runs;
- ``self-test``: the converted model cached, the self-test's earlier pass removed (what a start
  on another CPU or after an upgrade of relaylm pays);
- ``warm``: everything cached (every later start on the same machine).

    python -m bench.worker_start_bench     # what `make bench-worker-start` runs (~2 min)

Prints a table and writes ``bench/results/worker_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.result_file import machine, write_result
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.stack import Process, Stack
from worker.settings import DEFAULT_MODEL

RESULTS = Path(__file__).parent / "results"
_SELF_TEST = re.compile(r"deterministic self-test (passed in ([0-9.]+) s|passed before)")


def _wait(condition: Any, timeout_s: float = 600.0) -> float:
    """Poll until ``condition()`` holds; the monotonic time it did."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not get there")
        time.sleep(0.01)
    return time.monotonic()


def _start(stack: Stack, holder: Process, cache_dir: Path, name: str) -> dict[str, Any]:
    """One new worker's milestones, in seconds from its launch, with a request already queued."""
    answer: dict[str, Any] = {}
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": f"Say hi ({name})."}],
            "max_tokens": 4, "temperature": 0, "stream": True}  # fmt: skip

    def ask() -> None:
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=900) as response:
            answer["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: {") or "first_token" in answer:
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):  # not the role chunk a waiting stream opens with
                    answer["first_token"] = time.monotonic()

    with holder.paused():
        asking = threading.Thread(target=ask)
        asking.start()
        time.sleep(0.5)  # queued: the only live worker is paused
        launched = time.monotonic()
        worker = stack.start_worker(
            DEFAULT_MODEL, DEFAULT_MODEL, wait=False, cache_dir=str(cache_dir), log_level="INFO", max_model_len=4096
        )
        worker_id = f"{stack.key_prefix}-worker{len(stack.workers) - 1}"
        registered = _wait(lambda: stack.worker_info(worker_id) is not None)
        ready = _wait(lambda: (info := stack.worker_info(worker_id)) is not None and info.state == "ready")
        claimed = _wait(lambda: worker_id in stack.running_jobs().values() or not asking.is_alive())
        asking.join(timeout=600)
    assert "first_token" in answer, f"the request got no answer (HTTP {answer.get('status')})"
    found = _SELF_TEST.search(worker.log())
    self_test_s = float(found.group(2)) if found and found.group(2) else 0.0
    worker.stop()
    stack.workers.remove(worker)
    return {
        "start": name,
        "registered_s": registered - launched,
        "ready_s": ready - launched,
        "first_job_claimed_s": claimed - launched,
        "first_token_s": answer["first_token"] - launched,
        "self_test_s": self_test_s,
        "self_test": "ran" if found and found.group(2) else ("cached" if found else "none"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "worker_start.json")
    args = parser.parse_args()

    binary = find_redis_server()
    own = start_redis(binary) if binary else None
    redis_url = own.url if own else os.environ.get("RELAYLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    cache_dir = Path(tempfile.mkdtemp(prefix="relaylm-start-cache-"))
    stack = Stack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-start-")))
    starts = []
    try:
        # The request waits for the new worker however long it loads (the default grace fails a
        # request that finds no ready worker for 3 s; the paused first worker soon is none).
        stack.start_api(log_level="WARNING", no_worker_grace_s=3600)
        holder = stack.start_worker(DEFAULT_MODEL, DEFAULT_MODEL, max_model_len=4096, log_level="WARNING")
        print("cold start ...", flush=True)
        starts.append(_start(stack, holder, cache_dir, "cold"))
        shutil.rmtree(cache_dir / "self-test", ignore_errors=True)
        print("self-test start ...", flush=True)
        starts.append(_start(stack, holder, cache_dir, "self-test"))
        print("warm start ...", flush=True)
        starts.append(_start(stack, holder, cache_dir, "warm"))
    finally:
        stack.stop()
        shutil.rmtree(cache_dir, ignore_errors=True)
        if own:
            own.stop()
    print()
    header = ["start", "registered", "ready", "first job claimed", "first token", "self-test"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for start in starts:
        test = f"{start['self_test_s']:.1f} s" if start["self_test"] == "ran" else start["self_test"]
        print(
            f"| {start['start']} | {start['registered_s']:.2f} s | {start['ready_s']:.2f} s "
            f"| {start['first_job_claimed_s']:.2f} s | {start['first_token_s']:.2f} s | {test} |"
        )
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.worker_start_bench",
        "model": DEFAULT_MODEL,
        "starts": starts,
    }
    write_result(args.out, report)


if __name__ == "__main__":
    main()
