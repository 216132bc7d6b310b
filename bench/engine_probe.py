"""The scaling benchmark's workload on the engine alone (no API, Redis or HTTP), in this process:
streams × tokens of the random-weight model, decoded for ``seconds``; prints deltas per second.

    taskset -c 0 python -m bench.engine_probe 48 10 [auto|native|transformers] [torch threads, default 1]

``bench.scaling_bench`` runs one pinned probe, then two at once on the two cores: what the
machine itself gives this workload when a second worker joins, with nothing else running.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench.in_process import InProcessEngine
from tests.support.models import tiny_random_llama_dir
from worker.engine.builder import EngineConfig
from worker.models.loader import load_model

OUTPUT_TOKENS = 64


def main() -> None:
    streams, seconds = int(sys.argv[1]), float(sys.argv[2])
    model_impl = sys.argv[3] if len(sys.argv) > 3 else "auto"
    torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    folder = tiny_random_llama_dir(hidden_size=512, num_layers=8)
    loaded = load_model(str(folder), Path("/nonexistent"), "cpu", "float32", 1024, model_impl)
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=1024, kv_cache_bytes=2**30)
    engine = InProcessEngine(loaded, config)

    def bodies() -> list[dict[str, object]]:
        return [
            {"model": "tiny-random", "messages": [{"role": "user", "content": f"go {i}"}],
             "max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
            for i in range(streams)
        ]  # fmt: skip

    engine.run(bodies())  # warm-up
    deltas, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        engine.run(bodies())
        deltas += streams * OUTPUT_TOKENS
    print(deltas / (time.perf_counter() - started))


if __name__ == "__main__":
    main()
