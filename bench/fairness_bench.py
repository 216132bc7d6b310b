"""Fair share between API keys: a quiet key's time to first token under another key's flood,
first come first served against the fair claim, in one run, on one worker and on two (each pinned
to a core of its own, one torch thread; a host with one core skips the second point), on the
default model.

The same workers serve two API processes on one Redis: one with ``--fair-share false`` (FIFO),
one with the default fair share. Per point:

- **solo**: key B sends short streamed requests one after another, alone: their TTFT p50/p95;
- **flood, FIFO** and **flood, fair**: key A keeps ``--flood`` long requests in flight while B
  sends the same short requests: B's TTFT p50/p95, and the tokens per second of everything
  served meanwhile (the throughput the fair claim must keep);

then, on the fair API and the first point's workers:

- **sizes**: A (long answers) and B (short ones) both keep ``--flood`` requests in flight for
  ``--share-s``: the tokens each key was served (from ``/metrics``), whose ratio VTC bounds;
- **weights**: A (weight 1) and C (weight 3) with the same requests: C's share over A's.

    python -m bench.fairness_bench           # what `make bench-fairness` runs (~10 min on 2 cores)

Prints a table and writes ``bench/results/fairness.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import re
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.pinned_workers import start_pinned_workers, worker_points
from bench.result_file import machine, write_result
from bench.stats import percentile_ms
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.stack import Stack
from worker.settings import DEFAULT_MODEL

RESULTS = Path(__file__).parent / "results"
SECRET = "fairness-bench-secret"
KEYS = {"A": "sk-bench-flood", "B": "sk-bench-quiet", "C": "sk-bench-weighted"}
WEIGHTS = {"A": 1, "B": 1, "C": 3}
QUIET_TOKENS = 8


def _owner(key: str) -> str:
    """The keyed hash /metrics names a key by (the API's, under the bench's secret)."""
    return hmac.new(SECRET.encode(), key.encode(), hashlib.sha256).hexdigest()[:32]


def _body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": stream,
    }  # fmt: skip


async def _ttft(client: httpx.AsyncClient, url: str, key: str, n: int) -> float:
    started = time.monotonic()
    body = _body(f"Question {n}: name a colour.", QUIET_TOKENS, stream=True)
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        response.raise_for_status()
        first: float | None = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.monotonic() - started
    assert first is not None
    return first


async def _keep_in_flight(
    client: httpx.AsyncClient, url: str, key: str, streams: int, max_tokens: int, stop: asyncio.Event, served: list[int]
) -> None:
    """``streams`` requests of ``key`` in flight until ``stop``; ``served``: their tokens, as they end."""

    async def loop(index: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = _body(f"Stream {index}, request {n}: write a long story.", max_tokens, stream=False)
            response = await client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
            response.raise_for_status()
            usage = response.json()["usage"]
            served.append(usage["prompt_tokens"] + usage["completion_tokens"])

    await asyncio.gather(*(loop(index) for index in range(streams)))


async def _quiet(base_url: str, args: argparse.Namespace, flood: int) -> dict[str, Any]:
    """B's TTFTs, alone (``flood`` 0: ``--requests`` of them) or under A's flood (as many as
    ``--flood-s`` fits, one after another), and the tokens per second served in that window."""
    url = f"{base_url}/v1/chat/completions"
    stop, served = asyncio.Event(), list[int]()
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=flood + 8)) as client:
        flooding = asyncio.create_task(_keep_in_flight(client, url, KEYS["A"], flood, args.flood_tokens, stop, served))
        if flood:
            await asyncio.sleep(args.warmup_s)
        before, started = sum(served), time.monotonic()
        ttfts: list[float] = []
        while len(ttfts) < args.requests if not flood else time.monotonic() - started < args.flood_s:
            ttfts.append(await _ttft(client, url, KEYS["B"], len(ttfts)))
        elapsed = time.monotonic() - started
        during = sum(served) - before
        stop.set()
        await flooding
    tok_s = (during + len(ttfts) * QUIET_TOKENS) / elapsed
    return {
        "requests": len(ttfts), "ttft_p50_ms": percentile_ms(ttfts, 50), "ttft_p95_ms": percentile_ms(ttfts, 95),
        "ttfts_s": ttfts, "tok_s": tok_s if flood else None,
    }  # fmt: skip


def _served(base_url: str) -> dict[str, float]:
    """Tokens served per key's keyed hash, from /metrics (interactive lane)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    served: dict[str, float] = {}
    for labels, value in re.findall(r"^relaylm:tenant_served_tokens_total\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        tenant = re.search(r'tenant="([^"]+)"', labels)
        if 'lane="interactive"' in labels and tenant:
            served[tenant.group(1)] = float(value)
    return served


async def _contend(base_url: str, sides: dict[str, int], streams: int, seconds: float) -> dict[str, float]:
    """Each key of ``sides`` (key name → answer tokens) keeps ``streams`` requests in flight for
    ``seconds``: the tokens each was served meanwhile, as /metrics counts them."""
    url = f"{base_url}/v1/chat/completions"
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=2 * streams + 8)) as client:
        tasks = [
            asyncio.create_task(_keep_in_flight(client, url, KEYS[name], streams, tokens, stop, []))
            for name, tokens in sides.items()
        ]
        await asyncio.sleep(5.0)  # both backlogged before the window opens
        before = _served(base_url)
        await asyncio.sleep(seconds)
        after = _served(base_url)
        stop.set()
        await asyncio.gather(*tasks)
    return {name: after.get(_owner(KEYS[name]), 0.0) - before.get(_owner(KEYS[name]), 0.0) for name in sides}


def _point(redis_url: str, workers: int, args: argparse.Namespace, key_file: Path) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="relaylm-fairness-"))
    fifo = Stack(redis_url=redis_url, log_dir=log_dir)
    fair = Stack(redis_url=redis_url, log_dir=log_dir, key_prefix=fifo.key_prefix)
    common = {"api_key_file": key_file, "owner_hash_secret": SECRET, "metrics_public": "true", "log_level": "WARNING"}
    try:
        fifo.start_api(fair_share="false", **common)
        fair.start_api(**common)
        pinned = start_pinned_workers(fifo, workers, max_model_len=2048)
        point: dict[str, Any] = {"workers": workers, "pinned": pinned}
        point["solo"] = asyncio.run(_quiet(fair.base_url, args, 0))
        point["flood_fifo"] = asyncio.run(_quiet(fifo.base_url, args, args.flood))
        point["flood_fair"] = asyncio.run(_quiet(fair.base_url, args, args.flood))
        if workers == 1:
            sizes = asyncio.run(_contend(fair.base_url, {"A": args.flood_tokens, "B": 16}, args.flood, args.share_s))
            weights = asyncio.run(_contend(fair.base_url, {"A": 64, "C": 64}, args.flood, args.share_s))
            point["sizes_served_tokens"] = sizes
            point["weights_served_tokens"] = weights
    finally:
        fair.stop()
        fifo.stop()
    return point


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="key B's short requests alone, one at a time")
    parser.add_argument("--flood-s", type=float, default=40.0, help="the window of B's requests under A's flood")
    parser.add_argument("--flood", type=int, default=64, help="key A's requests kept in flight")
    parser.add_argument("--flood-tokens", type=int, default=64, help="the answer tokens of each of A's requests")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="A's flood runs this long before B starts")
    parser.add_argument("--share-s", type=float, default=60.0, help="the window of the sizes and weights phases")
    parser.add_argument("--workers", default="1,2", help="the points (each needs as many cores)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness.json")
    args = parser.parse_args()

    key_file = Path(tempfile.mkdtemp(prefix="relaylm-fairness-keys-")) / "keys"
    key_file.write_text("".join(f"{KEYS[name]} weight={WEIGHTS[name]}\n" for name in KEYS))
    binary = find_redis_server()
    own = start_redis(binary) if binary else None
    redis_url = own.url if own else os.environ.get("RELAYLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    points = []
    fit, skipped = worker_points(args.workers)
    try:
        for workers in fit:
            print(f"{workers} worker(s): solo, flood FIFO, flood fair ...", flush=True)
            points.append(_point(redis_url, workers, args, key_file))
    finally:
        if own:
            own.stop()

    print()
    header = ["workers", "B alone p50 / p95", "under flood, FIFO p50 / p95 (requests)",
              "under flood, fair p50 / p95 (requests)", "fair p95 / alone p95", "throughput fair / FIFO"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    summary: dict[str, Any] = {}
    for point in points:
        solo, fifo, fair = point["solo"], point["flood_fifo"], point["flood_fair"]
        p95_ratio = fair["ttft_p95_ms"] / solo["ttft_p95_ms"]
        throughput = fair["tok_s"] / fifo["tok_s"]
        summary[str(point["workers"])] = {
            "fair_p95_over_solo_p95": p95_ratio,
            "fifo_p95_over_solo_p95": fifo["ttft_p95_ms"] / solo["ttft_p95_ms"],
            "throughput_fair_over_fifo": throughput,
        }
        print(
            f"| {point['workers']} | {_ms(solo['ttft_p50_ms'])} / {_ms(solo['ttft_p95_ms'])} "
            f"| {_ms(fifo['ttft_p50_ms'])} / {_ms(fifo['ttft_p95_ms'])} ({fifo['requests']}) "
            f"| {_ms(fair['ttft_p50_ms'])} / {_ms(fair['ttft_p95_ms'])} ({fair['requests']}) "
            f"| {p95_ratio:.2f}x | {throughput:.2f}x |"
        )
    first = points[0] if points else {}
    if "sizes_served_tokens" in first:
        sizes, weights = first["sizes_served_tokens"], first["weights_served_tokens"]
        sizes_ratio = max(sizes.values()) / max(1.0, min(sizes.values()))
        weight_ratio = weights["C"] / max(1.0, weights["A"])
        summary["sizes_served_max_over_min"] = sizes_ratio
        summary["weight_3_over_weight_1"] = weight_ratio
        window = f"{args.share_s:.0f} s"
        print(f"\nsizes ({window}, A long answers, B short): served tokens {sizes}, max/min {sizes_ratio:.2f}")
        print(f"weights ({window}, C weight 3, A weight 1): served tokens {weights}, C/A {weight_ratio:.2f}")
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.fairness_bench",
        "model": DEFAULT_MODEL,
        "settings": {name: value for name, value in vars(args).items() if name != "out"},
        "points": points,
        "skipped_workers": skipped,
        "summary": summary,
    }
    write_result(args.out, json.loads(json.dumps(report, default=str)))


if __name__ == "__main__":
    main()
