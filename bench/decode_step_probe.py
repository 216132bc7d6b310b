"""Where one stream's decode step goes: the default model's forward for one row, timed over
``steps`` steps after a warm-up, then profiled by torch's profiler (the ten costliest ops).

    python -m bench.decode_step_probe [--threads 1,2] [--quantization auto] [--steps 200] [--compiled]

No sampling, engine loop, API or Redis: this is the floor a single stream's step sits on. The
difference between one and two threads shows how much of the step does not parallelise (the
per-call cost of many small torch ops and Python). ``--compiled`` also times the same step as
the worker's AOTInductor package (``worker/native/compiled_decode.py``; built here the first time,
~40 s, and cached under ~/.cache/relaylm/compiled): first how often a fixed walk of 99 tokens
takes the eager step's greedy argmax, then three alternated timing runs of each. Prints a table;
writes bench/results/decode_step.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.quantization_bench import _Chunk
from tests.support.models import default_model_dir
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import PrefillChunk
from worker.models.loader import load_model
from worker.native.compiled_decode import CompiledDecode, CompileState, build_package, package_key
from worker.native.decoder import NativeCausalLM
from worker.native.kv_cache import KVCacheLayout, SlotKVCache
from worker.settings import default_cache_dir

RESULTS = Path(__file__).parent / "results" / "decode_step.json"
WARMUP_STEPS = 50
AGREEMENT_STEPS = 99


def step_ms(runner: ModelRunner, start: int, steps: int) -> float:
    began = time.perf_counter()
    for position in range(start, start + steps):
        runner.decode([5], [position])
    return (time.perf_counter() - began) / steps * 1000


def compiled_vs_eager(model: NativeCausalLM, layout: KVCacheLayout, threads: int, steps: int) -> dict[str, object]:
    """The eager and the compiled one-row step, three alternated timings of ``steps`` each."""
    cache = SlotKVCache(layout, 1, 1024)
    path = default_cache_dir() / "compiled" / f"{package_key(model, cache, threads)}.pt2"
    if not path.exists():
        began = time.perf_counter()
        build_package(model, cache, path)
        print(f"    built {path} in {time.perf_counter() - began:.1f} s")
    runners = {"eager": ModelRunner(model, SlotKVCache(layout, 1, 1024)), "compiled": ModelRunner(model, cache)}
    compiled = CompiledDecode(model, cache, path.parent.parent, [])
    compiled._runner, compiled.num_threads = torch._inductor.aoti_load_package(str(path)), threads
    compiled.state = CompileState.READY
    runners["compiled"].compiled = compiled
    for runner in runners.values():
        runner.prefill([PrefillChunk(_Chunk([1]), 0, 1)])  # type: ignore[arg-type]
    # Agreement first: the same walk of AGREEMENT_STEPS tokens through both, argmax by argmax.
    agreed, max_diff = 0, 0.0
    for position in range(1, 1 + AGREEMENT_STEPS):
        token = 5 + position % 50
        eager_logits, compiled_logits = (runner.decode([token], [position]) for runner in runners.values())
        agreed += int(eager_logits.argmax() == compiled_logits.argmax())
        max_diff = max(max_diff, float((eager_logits - compiled_logits).abs().max()))
    print(f"    greedy argmax agreement with the eager step: {agreed}/{AGREEMENT_STEPS} (max |dlogit| {max_diff:.3f})")
    start = 1 + AGREEMENT_STEPS
    timings: dict[str, list[float]] = {"eager": [], "compiled": []}
    for runner in runners.values():
        step_ms(runner, start, WARMUP_STEPS)
    for run in range(3):
        for label, runner in runners.items():
            timings[label].append(step_ms(runner, start + WARMUP_STEPS + run * steps, steps))
    eager, fast = statistics.median(timings["eager"]), statistics.median(timings["compiled"])
    print(f"    eager {eager:.2f} ms, compiled {fast:.2f} ms per step (medians of 3): {eager / fast:.2f}x")
    return {"eager_step_ms_runs": timings["eager"], "compiled_step_ms_runs": timings["compiled"],
            "compiled_speedup": eager / fast, "argmax_agreement": f"{agreed}/{AGREEMENT_STEPS}",
            "max_abs_logit_diff": max_diff}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compiled", action="store_true", help="also time the compiled one-row step")
    args = parser.parse_args()
    loaded = load_model(str(default_model_dir()), Path("/nonexistent"), "cpu", "auto", 1024, "native",
                        args.quantization)  # fmt: skip
    layout = KVCacheLayout.from_config(loaded.model.config, loaded.model.dtype, torch.device("cpu"))
    rows = []
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            runner = ModelRunner(loaded.model, SlotKVCache(layout, 1, 1024))
            runner.prefill([PrefillChunk(_Chunk([1]), 0, 1)])  # type: ignore[arg-type]
            step_ms(runner, 1, WARMUP_STEPS)
            timed = step_ms(runner, 1 + WARMUP_STEPS, args.steps)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step_ms(runner, 1 + WARMUP_STEPS + args.steps, 50)
            ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
            top = {op.key: {"calls_per_step": op.count / 50, "ms_per_step": op.self_cpu_time_total / 50 / 1000}
                   for op in ops}  # fmt: skip
            rows.append({"threads": threads, "step_ms": timed, "top_ops": top})
            print(f"threads {threads}: {timed:.2f} ms per one-row decode step ({1000 / timed:.1f} steps/s)")
            for name, cost in top.items():
                print(f"    {name:<52} {cost['calls_per_step']:>6.0f} calls {cost['ms_per_step']:>7.3f} ms")
            if args.compiled:
                rows[-1].update(compiled_vs_eager(loaded.model, layout, threads, args.steps))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    summary = {"cpu": cpu, "dtype": str(loaded.model.dtype), "quantization": args.quantization, "rows": rows}
    RESULTS.write_text(json.dumps(summary, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
