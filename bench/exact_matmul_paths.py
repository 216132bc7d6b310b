"""The exact kernels' matmul on CPUs with and without AVX512-VNNI: the vector code against the
portable code (forced with ``scalar=True``; on an AVX2 CPU its matmul runs in AVX2, several rows
per pass over the weights), on SmolLM2-135M's shapes and its GGUF's bit widths, one thread.

    python -m bench.exact_matmul_paths

Both paths give the same bits (``tests/worker/test_exact_kernels.py``); this measures what the
portable one costs. Prints a table; writes bench/results/exact_matmul_paths.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.result_file import cpu_name
from worker.native import exact

RESULTS = Path(__file__).parent / "results" / "exact_matmul_paths.json"
# (out, in, bits): the MLP's 4-bit projections and the 8-bit output head.
SHAPES = {"gate_proj": (1536, 576, 4), "down_proj": (576, 1536, 4), "lm_head": (49152, 576, 8)}
ROWS = (1, 64)


def _weight(out_features: int, in_features: int, bits: int) -> exact.PackedWeight:
    generator = torch.Generator().manual_seed(0)
    groups = in_features // 32
    if bits == 8:
        return exact.pack_int8(torch.randn(out_features, in_features, generator=generator))
    values = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scale = torch.rand(out_features, groups, generator=generator) * 0.1
    minimum = -torch.rand(out_features, groups, generator=generator)
    return exact.pack_int4(values, scale, minimum)


def _milliseconds(x: torch.Tensor, weight: exact.PackedWeight, scalar: bool) -> float:
    exact.matmul(x, weight, scalar=scalar)
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.5:
        exact.matmul(x, weight, scalar=scalar)
        runs += 1
    return (time.perf_counter() - started) / runs * 1000


def main() -> None:
    if not exact.load():
        raise SystemExit("the exact kernels did not build here")
    torch.set_num_threads(1)
    results = []
    for name, (out_features, in_features, bits) in SHAPES.items():
        weight = _weight(out_features, in_features, bits)
        for rows in ROWS:
            x = torch.randn(rows, in_features).to(torch.bfloat16)
            vector = _milliseconds(x, weight, scalar=False) if exact.has_vector_path() else None
            portable = _milliseconds(x, weight, scalar=True)
            results.append({"shape": name, "bits": bits, "rows": rows, "vector_ms": vector, "portable_ms": portable})
    report = {"command": "python -m bench.exact_matmul_paths", "machine": cpu_name(), "results": results}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"{report['machine']}, one thread\n")
    print("| matmul | rows | AVX512-VNNI | portable | portable ÷ vector |\n|---|---:|---:|---:|---:|")
    for r in results:
        vector = "—" if r["vector_ms"] is None else f"{r['vector_ms']:.2f} ms"
        ratio = "—" if r["vector_ms"] is None else f"{r['portable_ms'] / r['vector_ms']:.1f}×"
        print(f"| {r['shape']} (int{r['bits']}) | {r['rows']} | {vector} | {r['portable_ms']:.2f} ms | {ratio} |")


if __name__ == "__main__":
    main()
