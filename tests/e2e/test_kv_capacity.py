"""The KV cache held by tokens, through the real stack: a worker whose budget used to make 8
full-length slots runs 64 short streams at once (the gauges say so), and when the streams grow
past the budget, sequences are preempted and recomputed; every stream still ends complete."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_stack
from tests.support.sse_load import run_load
from tests.support.stack import Stack, wait_until

MODEL = "tiny-kv"
MAX_LEN = 1024
# The tiny model in fp32: 512 bytes of KV a token. 9 full-length sequences' worth, which the
# slot cache split into 8 slots (and a scratch one): 144 blocks of 64 tokens.
BUDGET_GIB = 9 * MAX_LEN * 512 / 2**30


@pytest.fixture
def kv_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        stack.start_worker(
            tiny_model_path, MODEL, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=64,
            kv_cache_memory_gib=BUDGET_GIB, heartbeat_interval_s=0.1,
        )  # fmt: skip
        yield stack
    finally:
        stack.stop()


def _gauges(stack: Stack) -> dict[str, float]:
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == MODEL and "worker" in sample.labels
    }


def _num_queued(stack: Stack) -> int:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return int(client.zcard(stack.keys.queue(MODEL)))
    finally:
        client.close()


def test_64_streams_run_at_once_and_outgrowing_the_budget_preempts_without_failing_any(kv_stack: Stack) -> None:
    peaks = {"relaylm:num_requests_running": 0.0, "relaylm:kv_cache_usage_perc": 0.0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for name, value in _gauges(kv_stack).items():
                if name in peaks:
                    peaks[name] = max(peaks[name], value)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # 64 x (prompt + 180 tokens) wants 256 blocks of the 144: they cannot all keep growing.
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 180,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    (worker,) = kv_stack.workers
    try:
        with ThreadPoolExecutor(1) as pool:
            # All 64 are queued before the worker takes any, so they run at once however fast the
            # engine is (one by one, each could end before the last one came).
            with worker.paused():
                load = pool.submit(asyncio.run, run_load(kv_stack.base_url, body, 64, 120, 1, request_timeout_s=120))
                wait_until(lambda: _num_queued(kv_stack) == 64, "the 64 streams were never all queued")
            tally = load.result()
    finally:
        stop.set()
        watcher.join()
    assert tally.completed_streams == 64 and not tally.errors and not tally.lost and not tally.duplicated
    assert peaks["relaylm:num_requests_running"] == 64
    assert peaks["relaylm:kv_cache_usage_perc"] > 0.9
    log = kv_stack.workers[0].log()
    assert "held by tokens: 144 blocks of 64 tokens" in log and "max concurrency 64" in log
    assert "preempted" in log
    assert log.count("event=finished completion_tokens=180") == 64  # preempted ones too, in full
