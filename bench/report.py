"""The benchmark report: JSON structure, the ratios it tracks, and the Markdown table."""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch

from bench.stats import RunSummary


def build_report(
    args: argparse.Namespace,
    dtype: str,
    device: str,
    summaries: list[RunSummary],
    hop: dict[str, float | None],
    prefix: dict[str, float | None],
    kv_layout: dict[str, Any] | None = None,
    determinism: dict[str, Any] | None = None,
) -> dict[str, Any]:
    def find(mode: str, concurrency: int) -> RunSummary | None:
        return next((s for s in summaries if s.mode.startswith(mode) and s.concurrency == concurrency), None)

    serial, stack32, stack1 = find("a", 1), find("c", 32), find("c", 1)
    targets: dict[str, Any] = {}
    if serial and stack32:
        targets["tok_s_32_over_serial"] = stack32.tok_s / serial.tok_s
        targets["itl_p99_over_p50_at_32"] = (stack32.itl_p99_ms or 0) / (stack32.itl_p50_ms or 1)
    if serial and stack1 and serial.decode_tok_s and stack1.decode_tok_s:
        targets["batch1_decode_stack_over_hf"] = stack1.decode_tok_s / serial.decode_tok_s
    peer1, peer32 = find("d", 1), find("d", 32)
    if stack1 and peer1:
        targets["tok_s_1_stack_over_llama_server"] = stack1.tok_s / peer1.tok_s
    if stack32 and peer32:
        targets["tok_s_32_stack_over_llama_server"] = stack32.tok_s / peer32.tok_s
    targets.update({"queue_hop_p50_ms": hop["hop_p50_ms"], "queue_hop_p99_ms": hop["hop_p99_ms"]})
    if kv_layout:
        targets["kv_held_by_tokens_over_slots_at_32"] = kv_layout["ratio_of_medians"]
    if determinism:
        targets["deterministic_on_over_off_at_32_in_process"] = determinism["on_over_off"]
    other1, other32 = find("e", 1), find("e", 32)
    for label, default, other in (("1", stack1, other1), ("32", stack32, other32)):
        if default and other:
            targets[f"tok_s_{label}_stack_default_over_other_deterministic"] = default.tok_s / other.tok_s
    plain1, plain32 = find("f", 1), find("f", 32)
    for label, default, plain, peer in (("1", stack1, plain1, peer1), ("32", stack32, plain32, peer32)):
        if default and plain:
            targets[f"tok_s_{label}_stack_speculative_over_off"] = default.tok_s / plain.tok_s
        if plain and peer:
            targets[f"tok_s_{label}_stack_speculative_off_over_llama_server"] = plain.tok_s / peer.tok_s
    return {
        "command": "python -m bench.serving_bench "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "llama_server_version")
        ),
        "llama_server_version": getattr(args, "llama_server_version", None),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "device": device,
        },
        "model": args.model,
        "dtype": dtype,
        "runs": [s.to_dict() for s in summaries],
        "queue_hop": hop,
        "prefix_cache": prefix,
        "kv_layout": kv_layout,
        "determinism": determinism,
        "targets": targets,
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def render_table(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']} · {report['dtype']} · {report['machine']['device']} · {report['when']}",
        "",
        "| mode | clients | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | decode tok/s/stream |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        cells = [run["tok_s"], run["ttft_p50_ms"], run["ttft_p99_ms"], run["itl_p50_ms"], run["itl_p99_ms"]]
        cells.append(run["decode_tok_s"])
        lines.append(f"| {run['mode']} | {run['concurrency']} | " + " | ".join(_fmt(c) for c in cells) + " |")
    hop, prefix, targets = report["queue_hop"], report["prefix_cache"], report["targets"]
    lines += [
        "",
        f"queue hop at concurrency 1 (TTFT stack − in-process, {hop['samples']} alternating pairs): "
        f"p50 {_fmt(hop['hop_p50_ms'], 2)} ms, p99 {_fmt(hop['hop_p99_ms'], 2)} ms "
        f"(paired; in-process TTFT p50 {_fmt(hop['in_process_ttft_p50_ms'], 2)} ms, "
        f"stack p50 {_fmt(hop['stack_ttft_p50_ms'], 2)} ms)",
        f"prefix cache ({_fmt(prefix['system_prompt_tokens'], 0)}-token shared system prompt): hit rate "
        f"{_fmt((prefix['hit_rate'] or 0) * 100)}%, TTFT p50 {_fmt(prefix['ttft_p50_ms_cache_off'])} ms off → "
        f"{_fmt(prefix['ttft_p50_ms_cache_on'])} ms on",
        *_kv_layout_line(report.get("kv_layout")),
        *_determinism_line(report.get("determinism")),
        "targets: " + ", ".join(f"{k} = {_fmt(v, 2)}" for k, v in targets.items()),
    ]
    return "\n".join(lines)


def _kv_layout_line(kv_layout: dict[str, Any] | None) -> list[str]:
    if not kv_layout:
        return []
    runs = ", ".join(
        f"{a:.1f}/{b:.1f}"
        for a, b in zip(kv_layout["tok_s_held_by_tokens"], kv_layout["tok_s_full_length_slots"], strict=True)
    )
    return [
        f"KV held by tokens vs full-length slots, in-process at {kv_layout['streams']} streams (tok/s, alternated: "
        f"{runs}): {kv_layout['ratio_of_medians']:.3f}x"
    ]


def _determinism_line(determinism: dict[str, Any] | None) -> list[str]:
    if not determinism:
        return []
    runs = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(determinism["tok_s_on"], determinism["tok_s_off"], strict=True))
    return [
        f"--deterministic on vs off, in-process at {determinism['streams']} streams (tok/s, alternated: {runs}): "
        f"{determinism['on_over_off']:.3f}x"
    ]
