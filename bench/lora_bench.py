"""LoRA adapters against the base model on one worker, in one run, on the default model: output
tok/s of 32 concurrent streams all on the base model against 32 spread round-robin over the base
model and 8 adapters (goal: ≥ 0.8×), and of one stream on the base model against one on an
adapter (goal: ≥ 0.9×).

    python -m bench.lora_bench            # what `make bench-lora` runs (~4 min on 2 quiet cores)
    python -m bench.lora_bench --quick    # a smoke run: 4 streams, 16 tokens, one round (~1-2 min)

The adapters: 8 of the default model, written by PEFT (``tests/support/adapters.py``) over its
converted folder (``tests.support.models.default_model_dir``), rank 16 on all seven targets
(q/k/v/o, gate/up/down), random weights in both halves (``lora_B`` too, which PEFT starts at
zero; scale 0.05, at which the adapted model still writes sense, other text than the base
model's), each its own seed; built once, under ``.cache/bench/lora/<settings>/a0..a7``.

The measurement: the API and one worker as real processes (``tests/support/stack.py``), the
worker on the default model started with ``--lora a0=...,...,a7=...`` and its default settings
otherwise (``--deterministic on``, ``--speculative ngram``, ``--max-loras 8``: every adapter
held ready). Every request greedy, streamed, ``ignore_eos``, so each decodes exactly
``--output-tokens``; prompts of ``--prompt-tokens`` after the chat template
(``bench/workload.py``), a fresh one for every stream of every run, so no run finds another's
prompt in the prefix cache (kept apart per adapter, it would otherwise favour one side). Each
round runs the four sides once, each pair back to back, its order reversed every other round
(base, adapters; then adapters, base), so the machine's drift falls on both sides alike; before
each run the bench waits (at most ``--quiet-wait-s``) for other processes' load to pass, and
records the cores they kept busy during it (``bench/machine_load.py``). Reported per side: the
median round's output tok/s (every stream's tokens over the wall time from the first request
sent to the last stream's end, prefill included), with the decode rate beside it in the JSON
(``bench.moe_bench.round_summary``); the ratio: the median of each round's adapters ÷ base,
the two measured back to back. The worker's n-gram speculation runs on both sides; the tokens
it kept per output token are recorded per run (the worker's counters, read after each run), as
an adapter's text can repeat itself more or less than the base model's.

Prints a table; writes bench/results/lora.json (lora-quick.json for --quick; with
``--speculative off``, lora-speculative-off.json).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import http_load
from bench.machine_load import CONTENDED_CORES, OtherLoad
from bench.moe_bench import round_summary, wait_for_compiled_decode
from bench.result_file import machine, write_result
from bench.stats import StreamTrace
from bench.workload import user_text_for_length
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.adapters import ALL_TARGETS, write_peft_adapter
from tests.support.models import default_model_dir
from tests.support.qwen import build_once
from tests.support.stack import Stack
from worker.settings import DEFAULT_MODEL

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
CACHE = REPO_ROOT / ".cache" / "bench" / "lora"
RANK = 16
ALPHA = 16  # scaling alpha / rank = 1
SCALE = 0.05  # the spread of the random weights in both halves
GOALS = {"streams": 0.8, "single": 0.9}  # adapters ÷ base, output tok/s
SIDES = ("base", "adapters")


def make_adapters(count: int) -> list[Path]:
    """``count`` PEFT adapters of the default model, built the first time."""
    settings = {"model": DEFAULT_MODEL, "rank": RANK, "alpha": ALPHA, "scale": SCALE, "targets": ALL_TARGETS}
    digest = hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=4).hexdigest()
    folder = CACHE / f"{DEFAULT_MODEL}-r{RANK}-all-{digest}"
    base = default_model_dir()
    adapters = []
    for index in range(count):
        target = folder / f"a{index}"
        if not target.exists():
            print(f"  writing adapter a{index} (PEFT, rank {RANK}, {len(ALL_TARGETS)} targets) ...", flush=True)
        adapters.append(build_once(target, functools.partial(_write_adapter, base, index)))
    return adapters


def _write_adapter(base: Path, seed: int, staging: Path) -> None:
    write_peft_adapter(base, staging, seed=seed, rank=RANK, alpha=ALPHA, scale=SCALE)


def side_models(side: str, streams: int, adapters: list[str], round_index: int) -> list[str]:
    """Each stream's ``model``: the base model's name on the base side; on the adapters' side, at
    several streams the base model and every adapter in turn, at one stream an adapter (another
    each round)."""
    if side == "base":
        return [DEFAULT_MODEL] * streams
    if streams == 1:
        return [adapters[round_index % len(adapters)]]
    names = [DEFAULT_MODEL, *adapters]
    return [names[index % len(names)] for index in range(streams)]


async def run_streams(base_url: str, models: list[str], texts: list[str], output_tokens: int) -> list[StreamTrace]:
    """One stream per text, ``models[i]``'s for ``texts[i]``, all at once (``http_load.run_streams``
    per model, gathered)."""
    groups: dict[str, list[str]] = {}
    for model, text in zip(models, texts, strict=True):
        groups.setdefault(model, []).append(text)
    runs = await asyncio.gather(
        *(http_load.run_streams(base_url, model, group, output_tokens) for model, group in groups.items())
    )
    return [trace for traces in runs for trace in traces]


class Bench:
    """The stack up, with its adapters: runs one side at a time, each on fresh prompts."""

    def __init__(self, stack: Stack, load: OtherLoad, adapters: list[str], args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        self.stack, self.load, self.adapters, self.args = stack, load, adapters, args
        self.worker_id = f"{stack.key_prefix}-worker0"
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        self._prompts = (user_text_for_length(tokenizer, index, args.prompt_tokens) for index in itertools.count())

    def texts(self, count: int) -> list[str]:
        return list(itertools.islice(self._prompts, count))

    def speculation(self) -> tuple[int, int]:
        """The worker's drafted and kept (accepted) tokens since it started, as its heartbeat says."""
        info = self.stack.worker_info(self.worker_id)
        return (info.spec_decode_num_draft_tokens, info.spec_decode_num_accepted_tokens) if info else (0, 0)

    def run(self, side: str, streams: int, round_index: int, output_tokens: int) -> dict[str, Any]:
        models = side_models(side, streams, self.adapters, round_index)
        texts = self.texts(streams)
        quiet_wait_s = self.load.wait_for_quiet()
        drafted, accepted = self.speculation()
        before = self.load.sample()
        traces = asyncio.run(run_streams(self.stack.base_url, models, texts, output_tokens))
        other_load = self.load.cores_since(before)
        time.sleep(1.0)  # the worker's next heartbeats carry its counters after the run
        drafted_after, accepted_after = self.speculation()
        done = round_summary(traces)
        output = sum(done["tokens"])
        if any(tokens != output_tokens for tokens in done["tokens"]):
            print(f"  {side} {streams}: token counts {sorted(set(done['tokens']))}", flush=True)
        return {
            **{key: value for key, value in done.items() if key != "tokens"},
            "models": sorted(set(models)),
            "output_tokens": output,
            "drafted_tokens": drafted_after - drafted,
            "accepted_draft_tokens_per_output_token": (accepted_after - accepted) / output if output else None,
            "other_load_cores": other_load,
            "quiet_wait_s": quiet_wait_s,
        }


def measure(bench: Bench, args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Warm-up runs, then ``args.rounds`` rounds of the four sides, each pair back to back, the
    pair's order reversed every other round."""
    scenarios = {"streams": args.streams, "single": 1}
    for streams in scenarios.values():
        for side in SIDES:  # the adapters' side warms every adapter up too
            bench.run(side, streams, 0, 8)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {side: [] for side in SIDES} for name in scenarios}
    for index in range(args.rounds):
        for scenario, streams in scenarios.items():
            for side in SIDES if index % 2 == 0 else SIDES[::-1]:
                run = bench.run(side, streams, index, args.output_tokens)
                runs[scenario][side].append(run)
                spec = run["accepted_draft_tokens_per_output_token"]
                print(
                    f"  round {index}: {streams} stream(s) on {side}: output {run['output_tok_s']:.1f} tok/s, "
                    f"decode {run['decode_tok_s']:.1f} tok/s, drafts kept {spec or 0:.2f}/token, "
                    f"other load {run['other_load_cores']:.2f} cores",
                    flush=True,
                )
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]], streams: int, goal: float) -> dict[str, Any]:
    """Each side's median round, the per-round ratios (adapters ÷ base, measured back to back) and their median."""
    medians = {side: sorted(runs[side], key=lambda run: run["output_tok_s"])[len(runs[side]) // 2] for side in SIDES}
    pairs = list(zip(runs["base"], runs["adapters"], strict=True))
    rounds_ratio = [adapters["output_tok_s"] / base["output_tok_s"] for base, adapters in pairs]
    rounds_decode_ratio = [adapters["decode_tok_s"] / base["decode_tok_s"] for base, adapters in pairs]
    ratio = statistics.median(rounds_ratio)
    return {
        "streams": streams,
        **{side: {**medians[side], "rounds": runs[side]} for side in SIDES},
        "ratio_output_tok_s": ratio,
        "rounds_ratio_output_tok_s": rounds_ratio,
        "ratio_of_median_output_tok_s": medians["adapters"]["output_tok_s"] / medians["base"]["output_tok_s"],
        "ratio_decode_tok_s": statistics.median(rounds_decode_ratio),
        "rounds_ratio_decode_tok_s": rounds_decode_ratio,
        "goal": goal,
        "met": ratio >= goal,
        "contended_rounds": sum(
            1
            for base, adapters in pairs
            if max(base["other_load_cores"], adapters["other_load_cores"]) > CONTENDED_CORES
        ),
    }


def check_listed(stack: Stack, adapters: list[str]) -> None:
    """Every adapter in ``GET /v1/models`` under the default model, before anything is measured."""
    cards = {card["id"]: card for card in httpx.get(f"{stack.base_url}/v1/models", timeout=10).json()["data"]}
    missing = [name for name in adapters if (cards.get(name) or {}).get("parent") != DEFAULT_MODEL]
    if missing:
        raise SystemExit(f"adapters not listed under {DEFAULT_MODEL}: {missing}")


def print_table(report: dict[str, Any]) -> None:
    """The table, from a report (``main``'s, or bench/results/lora.json's)."""
    scenarios, count = report["scenarios"], report["adapters"]["count"]
    print()
    print(
        f"{DEFAULT_MODEL}, {count} adapters (rank {report['adapters']['rank']}, all 7 targets); "
        f"{report['prompt_tokens']} prompt tokens, {report['output_tokens']} out, greedy; median of "
        f"{report['rounds']} round(s); ratio: median of the rounds' adapters ÷ base"
    )
    print("| streams | base tok/s | adapters tok/s | adapters ÷ base | goal | met? | rounds' ratios | decode ratio |")
    print("|---|---:|---:|---:|---:|---|---|---:|")
    for scenario, row in scenarios.items():
        used = len([model for model in row["adapters"]["models"] if model != DEFAULT_MODEL])
        spread = f"base + {used} adapters, round-robin" if scenario == "streams" else "one adapter"
        rounds = ", ".join(f"{ratio:.2f}" for ratio in row["rounds_ratio_output_tok_s"])
        print(
            f"| {row['streams']} ({spread}) | {row['base']['output_tok_s']:.1f} | "
            f"{row['adapters']['output_tok_s']:.1f} | {row['ratio_output_tok_s']:.2f}× | ≥ {row['goal']:.1f}× | "
            f"{'yes' if row['met'] else 'no'} | {rounds} | {row['ratio_decode_tok_s']:.2f}× |"
        )
    print()
    for row in scenarios.values():
        spec = {side: row[side]["accepted_draft_tokens_per_output_token"] or 0.0 for side in SIDES}
        print(
            f"{row['streams']} stream(s): drafts kept per output token (median round) base {spec['base']:.2f}, "
            f"adapters {spec['adapters']:.2f}; rounds with other load over {CONTENDED_CORES} cores: "
            f"{row['contended_rounds']} of {report['rounds']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams of the first scenario")
    parser.add_argument("--adapters", type=int, default=8, help="adapters served (the worker's --max-loras is 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the four sides (pairs in the order ABBA)")
    parser.add_argument("--quiet-wait-s", type=float, default=10.0, help="most wait for other load before a run")
    parser.add_argument(
        "--speculative", choices=("ngram", "off"), default="ngram",
        help="the worker's speculation (off: the adapters' own cost, without drafts kept more on one side)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 streams, 16 tokens, one round")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/lora.json (lora-quick.json)")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.output_tokens, args.rounds, args.quiet_wait_s = 4, 16, 1, 0.0
    suffix = "" if args.speculative == "ngram" else "-speculative-off"
    out = args.out or RESULTS / (f"lora{suffix}-quick.json" if args.quick else f"lora{suffix}.json")
    timings: dict[str, float] = {}
    began = time.monotonic()

    folders = make_adapters(args.adapters)
    names = [folder.name for folder in folders]
    timings["adapters"] = round(time.monotonic() - began, 1)
    binary = find_redis_server()
    own = start_redis(binary) if binary else None
    redis_url = own.url if own else os.environ.get("RELAYLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    stack = Stack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-lora-")))
    try:
        stack.start_api(log_level="WARNING")
        started = time.monotonic()
        lora = ",".join(f"{folder.name}={folder}" for folder in folders)
        worker = stack.start_worker(
            DEFAULT_MODEL, DEFAULT_MODEL, log_level="WARNING", lora=lora, speculative=args.speculative
        )
        timings["worker start"] = round(time.monotonic() - started, 1)
        print(f"  worker ready with {len(names)} adapters: {timings['worker start']:.1f} s", flush=True)
        wait_for_compiled_decode(stack)
        check_listed(stack, names)
        assert stack.api is not None
        ours = [os.getpid(), stack.api.popen.pid, worker.popen.pid]
        if own and own.process:
            ours.append(own.process.pid)
        bench = Bench(stack, OtherLoad(ours, args.quiet_wait_s), names, args)
        started = time.monotonic()
        runs = measure(bench, args)
        timings["runs"] = round(time.monotonic() - started, 1)
        worker_log = str(worker.log_path)
    finally:
        stack.stop()
        if own:
            own.stop()
    timings["total"] = round(time.monotonic() - began, 1)

    counts = {"streams": args.streams, "single": 1}
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(["python -m bench.lora_bench", *sys.argv[1:]]),
        "model": DEFAULT_MODEL,
        "worker_settings": (
            f"defaults (--deterministic on, --max-loras 8), --speculative {args.speculative}, --lora {lora}"
        ),
        "adapters": {
            "count": len(names),
            "rank": RANK,
            "alpha": ALPHA,
            "targets": list(ALL_TARGETS),
            "init_scale": SCALE,
            "folders": [str(folder) for folder in folders],
            "bytes_each": sum(path.stat().st_size for path in folders[0].iterdir() if path.is_file()),
        },
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "rounds": args.rounds,
        "scenarios": {
            scenario: summarize(runs[scenario], counts[scenario], GOALS[scenario]) for scenario in ("streams", "single")
        },
        "worker_log": worker_log,
        "timings_s": timings,
    }
    print_table(report)
    write_result(out, report)


if __name__ == "__main__":
    main()
