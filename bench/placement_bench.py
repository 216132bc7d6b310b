"""Placement by prefix: agent-like sessions over one worker and over two and three, each worker
pinned to a core of its own (``taskset``, one torch thread: on a host of their own they would not
share cores either; a host with fewer cores than workers skips that point), with the claim's
placement off (``--placement-window-s 0``: the first worker to ask takes each job) and on (the
default window), in one run, on the default model.

Each session has a long system prompt and a conversation that grows every turn (the model's
answer, then a new user message); the sessions' turns interleave irregularly (a seeded shuffle
that keeps each session's turns in order), two requests in flight at a time. Reported per
setting: follow-up TTFT p50/p90, the share of follow-up prompt tokens served from the prefix
cache, the share of follow-ups served at least 90 % from cache, and the throughput on distinct
one-message prompts (which share no prefix) at 8 streams, which placement must not lower: the
sides of each point share the same workers behind two API processes (one with placement off,
one with it on) and alternate throughput rounds (off, on; on, off; ...), so the machine's drift
and any order effect fall on both.

    python -m bench.placement_bench          # what `make bench-placement` runs (~10 min on 2 cores)

Prints a table and writes ``bench/results/placement.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
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
SYSTEM_WORDS = 2300  # about 2,500 tokens of system prompt per session
OUTPUT_TOKENS = 16
IN_FLIGHT = 2


def _system_prompt(session: int) -> str:
    rng = random.Random(session)
    words = ["plan", "file", "test", "edit", "search", "run", "read", "commit", "diff", "tool", "shell", "patch"]
    rules = " ".join(rng.choice(words) for _ in range(SYSTEM_WORDS))
    return f"You are coding agent {session}. Follow these rules exactly: {rules}"


def _schedule(sessions: int, turns: int, seed: int) -> list[int]:
    """Session numbers in the order their next turn is sent: every session's turns in order,
    the sessions interleaved irregularly."""
    order = [session for session in range(sessions) for _ in range(turns)]
    random.Random(seed).shuffle(order)
    return order


async def _turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "model": DEFAULT_MODEL, "messages": messages, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.monotonic()
    ttft_s: float | None = None
    text, usage = "", None
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice["delta"].get("content")
                if content:
                    ttft_s = ttft_s if ttft_s is not None else time.monotonic() - started
                    text += content
    assert usage is not None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": ttft_s, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached, "text": text}


async def _sessions(base_url: str, numbers: range, turns: int, seed: int) -> list[dict[str, Any]]:
    """Every turn's measures, ``follow_up`` set on all but a session's first; ``numbers``: the
    sessions' (each its own system prompt)."""
    url = f"{base_url}/v1/chat/completions"
    sessions = len(numbers)
    conversations = [[{"role": "system", "content": _system_prompt(n)}] for n in numbers]
    busy = [asyncio.Lock() for _ in range(sessions)]  # a session's next turn waits for its answer
    sent = [0] * sessions
    slots = asyncio.Semaphore(IN_FLIGHT)
    results: list[dict[str, Any]] = []

    async def one(session: int) -> None:
        async with busy[session], slots:
            turn = sent[session]
            sent[session] += 1
            messages = [*conversations[session], {"role": "user", "content": f"Step {turn}: go on with the task."}]
            measured = await _turn(client, url, messages)
            conversations[session] = [*messages, {"role": "assistant", "content": measured.pop("text")}]
            results.append({**measured, "session": session, "follow_up": turn > 0})

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for session in _schedule(sessions, turns, seed):
            tasks.append(asyncio.create_task(one(session)))
            await asyncio.sleep(0)  # queued in schedule order on the session's lock
        await asyncio.gather(*tasks)
    return results


_DISTINCT = iter(range(10**9))


async def _distinct_throughput(base_url: str, streams: int, duration_s: float) -> float:
    """Generated tokens per second over ``streams`` clients sending prompts that share nothing."""
    url = f"{base_url}/v1/chat/completions"
    deadline = time.monotonic() + duration_s
    tokens = 0
    counter = _DISTINCT

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while time.monotonic() < deadline:
            body = {
                "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": f"Prompt {next(counter)}: say more."}],
                "max_tokens": 32, "ignore_eos": True, "temperature": 0,
            }  # fmt: skip
            response = await client.post(url, json=body)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
    return tokens / (time.monotonic() - started)


def _summary(turns: list[dict[str, Any]], throughput: float | None) -> dict[str, Any]:
    follow_ups = [t for t in turns if t["follow_up"]]
    ttfts = [t["ttft_s"] for t in follow_ups if t["ttft_s"] is not None]
    prompt = sum(t["prompt_tokens"] for t in follow_ups)
    cached = sum(t["cached_tokens"] for t in follow_ups)
    mostly = [t for t in follow_ups if t["cached_tokens"] >= 0.9 * t["prompt_tokens"]]
    return {
        "follow_ups": len(follow_ups),
        "follow_up_ttft_p50_ms": percentile_ms(ttfts, 50),
        "follow_up_ttft_p90_ms": percentile_ms(ttfts, 90),
        "follow_up_cached_share": cached / prompt if prompt else 0.0,
        "follow_ups_served_90pct_from_cache": len(mostly) / len(follow_ups) if follow_ups else 0.0,
        "distinct_tok_s": throughput,
        "turns": turns,
    }


def _one_worker(redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-placement-")))
    try:
        stack.start_api(placement_window_s=0, log_level="WARNING")
        pinned = start_pinned_workers(stack, 1, max_model_len=4096)
        turns = asyncio.run(_sessions(stack.base_url, range(args.sessions), args.turns, args.seed))
    finally:
        stack.stop()
    return {"workers": 1, "placement": "off", "pinned": pinned, **_summary(turns, None)}


def _several_workers(redis_url: str, args: argparse.Namespace, workers: int) -> list[dict[str, Any]]:
    """The same ``workers`` workers behind two API processes, one with placement off and one with
    it on: sessions through each (their own system prompts, so neither finds the other's in a
    cache), then the distinct-prompt throughput in alternated rounds."""
    off = Stack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-placement-off-")))
    on = Stack(
        redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-placement-on-")), key_prefix=off.key_prefix
    )
    try:
        off.start_api(placement_window_s=0, log_level="WARNING")
        on.start_api(placement_window_s=args.window_s, log_level="WARNING")
        pinned = start_pinned_workers(off, workers, max_model_len=4096)
        sessions = args.sessions
        turns_off = asyncio.run(_sessions(off.base_url, range(sessions), args.turns, args.seed))
        turns_on = asyncio.run(_sessions(on.base_url, range(sessions, 2 * sessions), args.turns, args.seed))
        rounds: dict[str, list[float]] = {"off": [], "on": []}
        for index in range(args.rounds):
            sides = (("off", off), ("on", on))
            for name, stack in sides if index % 2 == 0 else sides[::-1]:  # off, on; then on, off; ...
                tok_s = asyncio.run(_distinct_throughput(stack.base_url, args.streams, args.round_s))
                rounds[name].append(tok_s)
    finally:
        on.stop()
        off.stop()
    return [
        {"workers": workers, "placement": name, "pinned": pinned, "distinct_rounds_tok_s": rounds[name],
         **_summary(turns, statistics.median(rounds[name]))}
        for name, turns in (("off", turns_off), ("on", turns_on))
    ]  # fmt: skip


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.0f}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6, help="turns per session (the first is not a follow-up)")
    parser.add_argument("--seed", type=int, default=7, help="the interleaving of the sessions' turns")
    parser.add_argument("--streams", type=int, default=8, help="clients of the distinct-prompt throughput")
    parser.add_argument("--rounds", type=int, default=4, help="throughput rounds per side, in the order ABBA")
    parser.add_argument("--round-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=2.0, help="the placement window when on")
    parser.add_argument("--workers", default="2,3", help="the points beyond one worker (each needs as many cores)")
    parser.add_argument("--out", type=Path, default=RESULTS / "placement.json")
    args = parser.parse_args()

    binary = find_redis_server()
    own = start_redis(binary) if binary else None
    redis_url = own.url if own else os.environ.get("RELAYLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        print("one worker ...", flush=True)
        runs = [_one_worker(redis_url, args)]
        fit, skipped = worker_points(args.workers)
        for workers in fit:
            print(f"{workers} workers, placement off and on ...", flush=True)
            runs += _several_workers(redis_url, args, workers)
    finally:
        if own:
            own.stop()
    one_p90 = runs[0]["follow_up_ttft_p90_ms"]
    print()
    header = ["workers", "placement", "follow-up TTFT p50", "p90", "p90 / one worker's", "cached share",
              "≥90 % cached", "distinct tok/s (median of rounds)"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for run in runs:
        p90 = run["follow_up_ttft_p90_ms"]
        ratio = f"{p90 / one_p90:.2f}x" if p90 and one_p90 else "-"
        tok_s = run["distinct_tok_s"]
        print(
            f"| {run['workers']} | {run['placement']} "
            f"| {_fmt(run['follow_up_ttft_p50_ms'], ' ms')} | {_fmt(p90, ' ms')} | {ratio} "
            f"| {run['follow_up_cached_share']:.1%} | {run['follow_ups_served_90pct_from_cache']:.1%} "
            f"| {'-' if tok_s is None else f'{tok_s:.1f}'} |"
        )
    sides = {(run["workers"], run["placement"]): run for run in runs[1:]}
    points = sorted({workers for workers, _ in sides})
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.placement_bench",
        "model": DEFAULT_MODEL,
        "sessions": args.sessions,
        "turns": args.turns,
        "runs": runs,
        "skipped_workers": skipped,
        "p90_over_one_worker_p90": {
            str(n): {
                side: sides[n, side]["follow_up_ttft_p90_ms"] / one_p90 if one_p90 else None for side in ("off", "on")
            }
            for n in points
        },
        "distinct_throughput_on_over_off": {
            str(n): sides[n, "on"]["distinct_tok_s"] / sides[n, "off"]["distinct_tok_s"] for n in points
        },
    }
    write_result(args.out, report)


if __name__ == "__main__":
    main()
