"""Where a request's tokens part from its tokens alone: 8 requests of the default model, greedy and
seeded, run alone, 8 at a time, with prefill chunked at 16 tokens, and again after their prompts
are in the prefix cache; for each, the output position where each request first differs from
its run alone (none: identical), with ``--deterministic`` on and off.

    python -m bench.determinism_probe [--tokens 40] [--modes on,off]

Prints a table and writes ``bench/results/determinism.json``. ~3 min per mode on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from worker.engine.builder import EngineConfig, build_engine
from worker.engine.engine import RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import EngineRequest
from worker.models.loader import LoadedModel, load_model
from worker.native.kv_cache import KVCacheLayout
from worker.settings import DEFAULT_MODEL, WorkerSettings

RESULTS = Path(__file__).parent / "results"
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "far",
    "away",
    "from",
    "home",
    "and",
    "then",
    "it",
    "rained",
]


class _Done:
    def __init__(self) -> None:
        self.ids: set[str] = set()

    def __call__(self, outputs: list[RequestOutput]) -> None:
        self.ids.update(output.request_id for output in outputs if output.is_done)


def _runs(loaded: LoadedModel, prompts: list[list[int]], tokens: int, seeded: bool) -> dict[str, list[list[int]]]:
    layout = KVCacheLayout.from_config(loaded.model.config, loaded.model.dtype, torch.device("cpu"))

    def engine(step_tokens: int, prefix_cache: bool) -> tuple[object, _Done]:
        config = EngineConfig(
            max_num_seqs=32,
            max_num_batched_tokens=step_tokens,
            max_model_len=1024,
            kv_cache_bytes=64 * layout.bytes_per_token * 1024,
            prefix_cache_bytes=2**28 if prefix_cache else 0,
        )
        done = _Done()
        return build_engine(loaded.model, loaded.tokenizer, config, loaded.eos_token_ids, done), done

    def request(name: str, i: int) -> EngineRequest:
        params = SamplingParams(
            temperature=0.8 if seeded else 0.0,
            seed=1234 + i if seeded else None,
            max_new_tokens=tokens,
            ignore_eos=True,
        )
        return EngineRequest(f"{name}{i}", [prompts[i]], params)

    def run(step_tokens: int, prefix_cache: bool, together: bool, warm: bool = False) -> list[list[int]]:
        eng, done = engine(step_tokens, prefix_cache)
        batches = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
        if warm:
            batches = [[i] for i in range(len(prompts))] + batches
        outputs: dict[int, list[int]] = {}
        for round_number, batch in enumerate(batches):
            requests = [request(f"b{round_number}-", i) for i in batch]
            for req in requests:
                eng.submit(req)  # type: ignore[attr-defined]
            while not {req.request_id for req in requests} <= done.ids:
                eng.run_step()  # type: ignore[attr-defined]
            for i, req in zip(batch, requests, strict=True):
                outputs[i] = req.sequences[0].output_token_ids
        return [outputs[i] for i in range(len(prompts))]

    return {
        "alone": run(256, prefix_cache=False, together=False),
        "8 at a time": run(256, prefix_cache=False, together=True),
        "prefill chunked at 16": run(16, prefix_cache=False, together=False),
        "after a prefix-cache hit": run(256, prefix_cache=True, together=False, warm=True),
    }


def _first_difference(tokens: list[int], alone: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, alone, strict=True)) if a != b), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--modes", default="on,off")
    parser.add_argument("--out", type=Path, default=RESULTS / "determinism.json")
    args = parser.parse_args()
    rng = random.Random(0)
    report: dict[str, object] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "tokens": args.tokens, "modes": {}}
    lines = ["| --deterministic | sampling | run | requests that differ from alone | first differing positions |"]
    lines.append("|---|---|---|---:|---|")
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))) for _ in range(8)]
    for mode in args.modes.split(","):
        loaded = load_model(DEFAULT_MODEL, WorkerSettings().cache_dir, "cpu", "auto", 1024, deterministic=mode == "on")
        report["dtype"] = str(loaded.model.dtype)
        prompts = [loaded.tokenizer.encode(text) for text in texts]
        results: dict[str, object] = {}
        for seeded in (False, True):
            runs = _runs(loaded, prompts, args.tokens, seeded)
            alone = runs["alone"]
            sampling = "seeded" if seeded else "greedy"
            for name, outputs in runs.items():
                if name == "alone":
                    continue
                firsts = [_first_difference(tokens, base) for tokens, base in zip(outputs, alone, strict=True)]
                results[f"{sampling}, {name}"] = firsts
                differing = sum(first is not None for first in firsts)
                shown = ", ".join("—" if first is None else str(first) for first in firsts)
                lines.append(f"| {mode} | {sampling} | {name} | {differing}/8 | {shown} |")
                print(lines[-1], flush=True)
        report["modes"][mode] = results  # type: ignore[index]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
