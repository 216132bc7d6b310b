"""Two checkouts of relaylm on the same machine at the same time: the full stack (an API and a
worker of the default model each, one Redis) at 1 and 32 streams, in alternated rounds
(before, after; after, before; ...), so the machine's drift falls on both sides. What tells a
change that should not move the serving numbers from one that does, when the VM's speed moves
by 10 % between runs of `make bench`.

    git worktree add /tmp/before <commit>
    python -m bench.compare_checkouts --before /tmp/before    # this checkout is "after"

Each side's processes run from its own checkout (its directory first on ``sys.path``); every
request's prompt (~110 tokens) is its own, so no prefix cache serves it. Prints a table and writes
``bench/results/compare_checkouts.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.http_load import run_streams
from bench.result_file import machine, write_result
from bench.stats import summarize
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.stack import Process, Stack
from worker.settings import DEFAULT_MODEL

RESULTS = Path(__file__).parent / "results"
HERE = Path(__file__).resolve().parents[1]


class CheckoutStack(Stack):
    """A stack whose processes import relaylm from ``checkout``."""

    checkout: Path = HERE

    def _spawn(self, role: str, name: str, settings: dict[str, object], prefix: tuple[str, ...] = ()) -> Process:
        log_path = self.log_dir / f"{self.key_prefix}-{name}.log"
        env = self.env(**settings)
        env["PYTHONPATH"] = str(self.checkout)
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [*prefix, sys.executable, "-m", "relaylm", role],
                env=env,
                cwd=self.checkout,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return Process(role, popen, log_path)


def _commit(checkout: Path) -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side and concurrency, ABBA")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompt-repeats", type=int, default=12, help="~10 tokens each: 600 gives a ~6k-token prefill")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=RESULTS / "compare_checkouts.json")
    args = parser.parse_args()

    binary = find_redis_server()
    own = start_redis(binary) if binary else None
    redis_url = own.url if own else os.environ.get("RELAYLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    sides: dict[str, CheckoutStack] = {}
    rounds: dict[str, dict[int, list[float]]] = {"before": {}, "after": {}}
    filler = "Describe how a queue works, step by step. " * args.prompt_repeats
    prompts = (f"Request {index}. {filler}" for index in range(10**9))
    try:
        for name, checkout in (("before", args.before.resolve()), ("after", HERE)):
            stack = CheckoutStack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix=f"relaylm-{name}-")))
            stack.checkout = checkout
            sides[name] = stack
            stack.start_api(log_level="WARNING")
            stack.start_worker(DEFAULT_MODEL, DEFAULT_MODEL, log_level="WARNING", max_model_len=args.max_model_len)
            asyncio.run(run_streams(stack.base_url, DEFAULT_MODEL, [next(prompts)], 8))  # warm up
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for index in range(args.rounds):
                order = ("before", "after") if index % 2 == 0 else ("after", "before")
                for name in order:
                    texts = [next(prompts) for _ in range(concurrency)]
                    traces = asyncio.run(run_streams(sides[name].base_url, DEFAULT_MODEL, texts, args.output_tokens))
                    tok_s = summarize(name, concurrency, traces).tok_s
                    rounds[name].setdefault(concurrency, []).append(tok_s)
                    print(f"c={concurrency} round {index} {name}: {tok_s:.1f} tok/s", flush=True)
    finally:
        for stack in sides.values():
            stack.stop()
        if own:
            own.stop()
    print()
    print("| streams | before tok/s (median) | after tok/s (median) | after ÷ before |")
    print("|---|---:|---:|---:|")
    ratios: dict[str, float] = {}
    for concurrency in rounds["before"]:
        before, after = (statistics.median(rounds[side][concurrency]) for side in ("before", "after"))
        ratios[str(concurrency)] = after / before
        print(f"| {concurrency} | {before:.1f} | {after:.1f} | {after / before:.3f} |")
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": f"python -m bench.compare_checkouts --before <checkout of {_commit(args.before)}>",
        "before": _commit(args.before),
        "after": _commit(HERE),
        "model": DEFAULT_MODEL,
        "output_tokens": args.output_tokens,
        "prompt_repeats": args.prompt_repeats,
        "rounds_tok_s": {side: {str(c): v for c, v in by_c.items()} for side, by_c in rounds.items()},
        "after_over_before": ratios,
    }
    write_result(args.out, report)


if __name__ == "__main__":
    main()
