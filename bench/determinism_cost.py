"""What ``--deterministic on`` costs, in-process on the default model: tok/s at 1 and 32 streams
with ``on``, ``off`` and ``on`` with ``--quantization int4`` (each model loaded as the worker
loads it), run in turn ``--rounds`` times after a warm-up; then the time to first token of a long
prompt (``--long-prompt-tokens``) with ``on`` and ``off``, alternated five times.

    python -m bench.determinism_cost [--output-tokens 64] [--max-model-len 2048]

Prints each run and writes ``bench/results/determinism_cost.json``. ~6 min on 2 cores.
``make bench`` measures the 32-stream ratio on its own; this adds one stream, int4 and prefill.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.in_process import InProcessEngine
from bench.serving_bench import alternated, bodies_for, engine_config
from bench.workload import distinct_prompts
from worker.engine.builder import default_max_num_batched_tokens
from worker.models.loader import LoadedModel, load_model
from worker.settings import DEFAULT_MODEL, WorkerSettings

RESULTS = Path(__file__).parent / "results" / "determinism_cost.json"
MODES = {"on": (True, "auto"), "off": (False, "auto"), "on-int4": (True, "int4")}
TTFT_RUNS = 5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-tokens", type=int, default=1800)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


def ttft_ms(models: dict[str, LoadedModel], args: argparse.Namespace) -> dict[str, list[float]]:
    """One long distinct prompt per run, ``on`` and ``off`` in turn, one output token."""
    texts = distinct_prompts(models["on"].tokenizer, TTFT_RUNS + 1, args.long_prompt_tokens)
    engines = {label: InProcessEngine(models[label], engine_config(args, 4)) for label in ("on", "off")}
    for engine in engines.values():
        engine.run(bodies_for(texts[:1], 1))  # warm-up
    times: dict[str, list[float]] = {label: [] for label in engines}
    for text in texts[1:]:
        for label, engine in engines.items():
            ttft = engine.run(bodies_for([text], 1))[0].ttft_s
            times[label].append(round(1000 * ttft, 1) if ttft is not None else float("nan"))
    for engine in engines.values():
        engine.close()
    return times


def main() -> None:
    args = parse_args()
    cache_dir = WorkerSettings().cache_dir
    models = {
        label: load_model(
            args.model,
            cache_dir,
            "auto",
            "auto",
            args.max_model_len,
            quantization=quantization,
            deterministic=deterministic,
        )
        for label, (deterministic, quantization) in MODES.items()
    }
    args.max_num_batched_tokens = default_max_num_batched_tokens(models["on"].model.device)
    texts = distinct_prompts(models["on"].tokenizer, 32, args.prompt_tokens)
    report: dict[str, Any] = {"model": args.model, "output_tokens": args.output_tokens, "tok_s": {}}
    for streams in (1, 32):
        engines = {label: InProcessEngine(models[label], engine_config(args, streams)) for label in models}
        tok_s = alternated(engines, bodies_for(texts[:streams], args.output_tokens), rounds=args.rounds)
        report["tok_s"][str(streams)] = tok_s
        print(f"{streams} streams, tok/s: {tok_s}", flush=True)
    report["ttft_ms"] = ttft_ms(models, args)
    print(f"TTFT of a ~{args.long_prompt_tokens}-token prompt, ms: {report['ttft_ms']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
