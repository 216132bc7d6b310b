"""PNG of a serving benchmark report: throughput and latency against concurrency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_results(report: dict[str, Any], path: Path) -> None:
    runs = report["runs"]
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = (("b", "in-process engine", "o--"), ("c", "full stack (HTTP + Redis)", "o-"),
              ("d", "llama-server, same GGUF", "^-"))  # fmt: skip
    for prefix, label, style in series:
        points = sorted((r["concurrency"], r) for r in runs if r["mode"].startswith(prefix))
        if not points:
            continue
        xs = [c for c, _ in points]
        throughput.plot(xs, [r["tok_s"] for _, r in points], style, label=label)
        if prefix == "c":
            latency.plot(xs, [r["ttft_p50_ms"] for _, r in points], "o-", label="TTFT p50")
            latency.plot(xs, [r["itl_p50_ms"] for _, r in points], "s-", label="ITL p50")
            latency.plot(xs, [r["itl_p99_ms"] for _, r in points], "s--", label="ITL p99")
    serial = next((r for r in runs if r["mode"].startswith("a")), None)
    if serial:
        throughput.axhline(serial["tok_s"], color="grey", linestyle=":", label="serial HF generate")
    throughput.set(
        xlabel="concurrent streams", ylabel="aggregate tok/s", title="Throughput", xscale="log", xticks=[1, 8, 32, 64]
    )
    throughput.set_xticklabels(["1", "8", "32", "64"])
    latency.set(xlabel="concurrent streams", ylabel="ms", title="Full-stack latency", xscale="log", yscale="log")
    latency.set_xticks([1, 8, 32, 64])
    latency.set_xticklabels(["1", "8", "32", "64"])
    for axis in (throughput, latency):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"{report['model']} · {report['dtype']} · {report['machine']['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
