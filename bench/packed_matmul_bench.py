"""Where the packed kernels of ``--quantization`` pay: one matmul of SmolLM2-135M's shapes, bf16
(oneDNN) against int8 and int4 packed weights, by number of input rows, on one thread.

    python -m bench.packed_matmul_bench

The weights here are small enough to stay in cache, so the ratios are the kernels' own; a real
decode step streams ~270 MB of weights from memory, where fewer bytes gain more. Prints a table;
writes bench/results/packed_matmul.json. ``worker/native/quantize.py`` picks PACKED_MAX_ROWS from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.native.quantize import Int4Linear, Int8Linear

RESULTS = Path(__file__).parent / "results" / "packed_matmul.json"
SHAPES = {"o_proj": (576, 576), "gate_proj": (1536, 576), "down_proj": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 32)


def _microseconds(run: Callable[[], torch.Tensor], seconds: float = 0.3) -> float:
    for _ in range(3):
        run()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        run()
        calls += 1
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    torch.set_num_threads(1)  # as a worker's step runs per thread (worker/service/engine_thread.py)
    torch.manual_seed(0)
    rows_out = []
    with torch.inference_mode():
        for name, (out_features, in_features) in SHAPES.items():
            weight = torch.randn(out_features, in_features)
            int8, int4 = Int8Linear(weight, None, torch.bfloat16), Int4Linear(weight, None, torch.bfloat16)
            dense = weight.to(torch.bfloat16)
            for rows in ROWS:
                x = torch.randn(rows, in_features, dtype=torch.bfloat16)
                bf16_us = _microseconds(lambda: F.linear(x, dense))  # noqa: B023
                int8_us = _microseconds(lambda: int8._packed_mm(x))  # noqa: B023
                int4_us = _microseconds(lambda: int4._packed_mm(x))  # noqa: B023
                rows_out.append({"shape": name, "rows": rows, "bf16_us": bf16_us, "int8_us": int8_us,
                                 "int4_us": int4_us})  # fmt: skip
    print(f"{'shape':>10} {'rows':>4} {'bf16 us':>9} {'int8 us':>9} {'int8 x':>7} {'int4 us':>9} {'int4 x':>7}")
    for r in rows_out:
        int8_x, int4_x = r["bf16_us"] / r["int8_us"], r["bf16_us"] / r["int4_us"]
        print(f"{r['shape']:>10} {r['rows']:>4} {r['bf16_us']:>9.1f} {r['int8_us']:>9.1f} {int8_x:>6.2f}x "
              f"{r['int4_us']:>9.1f} {int4_x:>6.2f}x")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"threads": 1, "dtype": "bfloat16", "rows": rows_out}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
