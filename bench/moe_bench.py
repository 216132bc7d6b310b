"""A Qwen3-MoE GGUF served by relaylm (``--model file.gguf``) against llama.cpp's llama-server on
the same Q4_K_M file: decode tok/s at 1 and at 32 concurrent streams, and the worker's resident
memory against the file's size.

    python -m bench.moe_bench            # what `make bench-moe` runs (~6 min on 2 cores, ~12 the first time)

The model: Qwen3-30B-A3B's layer layout (every layer a mixture of experts, 8 of them taken per
token and their weights renormalised, q/k norms, grouped-query attention, untied embeddings, the
real Qwen3 tokenizer) scaled down to a 2-core, 24 GiB machine: 24 layers 1024 wide, 16 heads
of 64 over 4 KV heads, 64 experts of 256 (1.58 B parameters; 0.37 B read per token, the output
head's 0.16 B included). Random weights (transformers' ``Qwen3MoeForCausalLM(config)``, seeded),
saved in bf16 with the tokenizer (``tests.support.qwen.qwen3_tokenizer_dir``), converted by
llama.cpp's own ``convert_hf_to_gguf.py`` (from the llama-cpp-python sdist that ``make
llama-server`` unpacks, with its vendored gguf-py) to a bf16 GGUF, then quantized to Q4_K_M by
``llama-quantize``; the bf16 GGUF is deleted after. All of it is built once, under
``.cache/bench/moe/<shape digest>/``. The converter takes the tokenizer as it is: it hashes the
pre-tokenizer's output on its test text, and this one hashes as Qwen2's (Qwen3 kept Qwen2's
pre-tokenizer), so the file says ``tokenizer.ggml.pre = qwen2`` with no override.

Why experts of 256 and not 384 (30B-A3B's 768 scaled by the width): llama.cpp's K-quants take
rows of 256 values, and ``ffn_down_exps`` has rows of the expert width; at 384 llama-quantize
falls back to Q5_0/Q8_0 for it, which the real model (768 = 3 x 256) never does. 256 keeps every
expert tensor in Q4_K/Q6_K, as in a real Q4_K_M file.

The measurement: the API and one worker as real processes (``tests/support/stack.py``; the
worker on the GGUF path with its default settings, so ``--deterministic on`` and ``--speculative
ngram``; and a second worker with ``--speculative off``, since a random model's greedy text
repeats itself, which n-gram drafts feed on more than a real model's would), and llama-server
with one slot per stream (``--no-repack``, as ``bench/llama_server_peer.py`` starts it), each
free to use every core. All three are up at once and take turns, the order reversed every other
round, so the machine's drift (large on a shared 2-core VM) falls on all alike. The same distinct
prompts (``bench/workload.py``), greedy, streamed, ``ignore_eos`` so every stream decodes exactly
``--output-tokens``. Each is warmed up at each stream count, then run ``--rounds`` times; the
median round is reported. Decode tok/s: the tokens after each
stream's first, over the time from the first stream's first token to the last stream's end (at one
stream, its decode rate; at 32, the batch's), with output tok/s over the whole wall time (prefill
included) beside it, and the sum of the streams' own decode rates in the JSON. The worker's VmRSS
(``/proc/<pid>/status``) is sampled after load and every 0.2 s while it serves; llama-server's
likewise (it maps the file, so its RSS counts the mapped pages it touched).

Prints a table; writes bench/results/moe.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import http_load, llama_server_peer
from bench.result_file import machine, write_result
from bench.stats import StreamTrace, percentile_ms
from bench.workload import distinct_prompts
from relaylm.redis_launcher import find_redis_server, start_redis
from tests.support.qwen import (
    ENDOFTEXT_ID,
    IM_END_ID,
    NUM_BPE_TOKENS,
    QWEN3_ADDED_TOKENS,
    build_once,
    qwen3_tokenizer_dir,
)
from tests.support.stack import Stack

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
CACHE = REPO_ROOT / ".cache" / "bench" / "moe"
LLAMA_BIN = REPO_ROOT / ".cache" / "llama.cpp" / "bin"
LLAMA_SOURCES = REPO_ROOT / ".cache" / "llama.cpp" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
SERVED_NAME = "qwen3-moe-bench"
SEED = 0
VOCAB_SIZE = -(-(NUM_BPE_TOKENS + len(QWEN3_ADDED_TOKENS)) // 64) * 64  # 151,680: padded, as Qwen3's checkpoints are
# Qwen3-30B-A3B's layout (48 layers of 2048, 32/4 heads of 128, 128 experts of 768, 8 taken),
# scaled down; see the module docstring for the expert width.
SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "intermediate_size": 3072,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def shape_key() -> str:
    digest = hashlib.blake2b(json.dumps({**SHAPE, "seed": SEED}, sort_keys=True).encode(), digest_size=6)
    return f"qwen3moe-{SHAPE['num_hidden_layers']}x{SHAPE['hidden_size']}-e{SHAPE['num_experts']}-{digest.hexdigest()}"


def _timed(what: str, timings: dict[str, float], step: Callable[[], Any]) -> Any:
    began = time.monotonic()
    result = step()
    timings[what] = round(time.monotonic() - began, 1)
    print(f"  {what}: {timings[what]:.1f} s", flush=True)
    return result


def build_checkpoint(staging: Path) -> None:
    """The random-weight Qwen3-MoE in bf16, with Qwen3's tokenizer and chat template."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID, decoder_sparse_step=1,
        mlp_only_layers=[], **SHAPE,
    )  # fmt: skip
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        torch.set_default_dtype(torch.bfloat16)  # initialised in bf16: no fp32 copy of ~1.6 B weights
        try:
            model = Qwen3MoeForCausalLM(config)
        finally:
            torch.set_default_dtype(default_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID, eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID
    )
    print(f"  checkpoint: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters", flush=True)
    model.save_pretrained(staging)
    del model
    shutil.copytree(qwen3_tokenizer_dir(), staging, dirs_exist_ok=True)


def parameter_counts(checkpoint: Path) -> dict[str, int]:
    """Total and per-token (active) parameters, from the safetensors headers."""
    total = experts = 0
    for shard in checkpoint.glob("*.safetensors"):
        with shard.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for size in entry["shape"]:
                count *= size
            total += count
            experts += count if ".mlp.experts." in name else 0
    embedding = VOCAB_SIZE * SHAPE["hidden_size"]  # one row of it is read per token
    active = total - experts + experts * SHAPE["num_experts_per_tok"] // SHAPE["num_experts"] - embedding
    return {"total": total, "experts": experts, "active_per_token": active}


def make_gguf(timings: dict[str, float]) -> tuple[Path, Path]:
    """The checkpoint and its Q4_K_M GGUF, built the first time."""
    folder = CACHE / shape_key()
    checkpoint = folder / "hf"
    gguf = folder / "model-Q4_K_M.gguf"
    if gguf.is_file():
        print(f"GGUF cached: {gguf} ({gguf.stat().st_size / 2**30:.2f} GiB)", flush=True)
        return checkpoint, gguf
    folder.mkdir(parents=True, exist_ok=True)
    _timed("random checkpoint (bf16)", timings, lambda: build_once(checkpoint, build_checkpoint))
    convert = LLAMA_SOURCES / "convert_hf_to_gguf.py"
    quantize = LLAMA_BIN / "llama-quantize"
    if not convert.is_file() or not quantize.is_file():
        raise SystemExit("needs llama.cpp's sources and llama-quantize: run `make llama-server` first")
    wide = folder / "model-bf16.gguf"
    if not wide.is_file():  # kept until the quantized file is made
        env = {**os.environ, "PYTHONPATH": str(LLAMA_SOURCES / "gguf-py")}  # its own gguf-py, not the venv's
        staging = folder / "model-bf16.partial.gguf"
        command = [sys.executable, str(convert), str(checkpoint), "--outfile", str(staging), "--outtype", "bf16"]
        _timed("convert_hf_to_gguf.py (bf16)", timings, lambda: subprocess.run(command, env=env, check=True))
        staging.rename(wide)
    partial = gguf.with_suffix(".partial")
    threads = str(len(os.sched_getaffinity(0)))
    command = [str(quantize), str(wide), str(partial), "Q4_K_M", threads]
    with (folder / "llama-quantize.log").open("wb") as log:  # a line per tensor: kept out of the table
        _timed("llama-quantize Q4_K_M", timings, lambda: subprocess.run(command, check=True, stdout=log, stderr=log))
    partial.rename(gguf)
    wide.unlink()
    print(f"GGUF: {gguf} ({gguf.stat().st_size / 2**30:.2f} GiB)", flush=True)
    return checkpoint, gguf


def vm_rss_bytes(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


class RssSampler:
    """VmRSS of one process every ``interval_s`` while the block runs: its peak and its median."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = vm_rss_bytes(self.pid)
            if rss is not None:
                self.samples.append(rss)
            self._stop.wait(self.interval_s)

    @contextlib.contextmanager
    def running(self) -> Iterator[RssSampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"samples": 0}
        return {"samples": len(self.samples), "max_bytes": max(self.samples),
                "median_bytes": int(statistics.median(self.samples))}  # fmt: skip


def child_pid(name: str) -> int | None:
    """A child of this process whose command is ``name`` (llama-server, which its helper starts)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if (
                int(fields[1]) == os.getpid()
                and Path((entry / "cmdline").read_bytes().split(b"\0")[0].decode()).name == name
            ):
                return int(entry.name)
    return None


def round_summary(traces: list[StreamTrace]) -> dict[str, Any]:
    started = min(trace.sent_at for trace in traces)
    finished = max(trace.finished_at for trace in traces)
    rates = [rate for rate in (trace.decode_tok_s for trace in traces) if rate is not None]
    ttfts = [ttft for ttft in (trace.ttft_s for trace in traces) if ttft is not None]
    first_token = min(trace.token_times[0] for trace in traces if trace.token_times)
    return {
        # Tokens after each stream's first, over the time from the first stream's first token to the
        # last stream's end: one stream's decode rate; for several, the batch's (a later stream's
        # prefill, where it overlaps others' decode, counts against it).
        "decode_tok_s": sum(trace.num_tokens - 1 for trace in traces) / (finished - first_token),
        "sum_of_stream_decode_tok_s": sum(rates),
        "per_stream_decode_tok_s_p50": statistics.median(rates) if rates else None,
        "output_tok_s": sum(trace.num_tokens for trace in traces) / (finished - started),
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "tokens": [trace.num_tokens for trace in traces],
        "wall_s": finished - started,
    }


@dataclass
class Server:
    """One system under test, up and warm: where to send requests, and the process to watch."""

    label: str
    base_url: str
    model: str
    pid: int | None
    facts: dict[str, Any] = field(default_factory=dict)


def measure(servers: list[Server], texts: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each stream count on every server: a warm-up each, then ``args.rounds`` rounds in which the
    servers take turns (the order reversed every other round, so the machine's drift falls on
    all alike); each server's median round."""
    results: dict[str, dict[str, Any]] = {server.label: {"by_streams": {}} for server in servers}
    samplers = {server.label: RssSampler(server.pid) for server in servers if server.pid}
    with contextlib.ExitStack() as running:
        for sampler in samplers.values():
            running.enter_context(sampler.running())
        for streams in args.streams:
            for server in servers:
                asyncio.run(http_load.run_streams(server.base_url, server.model, texts[:streams], 8))  # warm-up
            rounds: dict[str, list[dict[str, Any]]] = {server.label: [] for server in servers}
            for index in range(args.rounds):
                for server in servers if index % 2 == 0 else servers[::-1]:
                    traces = asyncio.run(
                        http_load.run_streams(server.base_url, server.model, texts[:streams], args.output_tokens)
                    )
                    done = round_summary(traces)
                    rounds[server.label].append(done)
                    if any(tokens != args.output_tokens for tokens in done["tokens"]):
                        print(f"  {server.label}: token counts {sorted(set(done['tokens']))}", flush=True)
                    print(
                        f"  {server.label} {streams} stream(s) round {index}: decode {done['decode_tok_s']:.1f} "
                        f"tok/s, output {done['output_tok_s']:.1f} tok/s",
                        flush=True,
                    )
            for label, runs in rounds.items():
                median = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]
                results[label]["by_streams"][str(streams)] = {
                    **{key: value for key, value in median.items() if key != "tokens"},
                    "rounds_decode_tok_s": [round(r["decode_tok_s"], 2) for r in runs],
                    "rounds_output_tok_s": [round(r["output_tok_s"], 2) for r in runs],
                }
    for server in servers:
        watched = samplers.get(server.label)
        results[server.label].update(server.facts, rss_while_serving=watched.summary() if watched else None)
    return results


def wait_for_compiled_decode(stack: Stack, timeout_s: float = 900.0) -> None:
    """As ``bench.serving_bench``'s (not imported: that module needs matplotlib): measure the
    worker warm, its one-row decode step compiled where it builds one."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        info = stack.worker_info(f"{stack.key_prefix}-worker0")
        if info is not None and info.compiled_decode != "building":
            print(f"  compiled decode step: {info.compiled_decode}", flush=True)
            return
        time.sleep(0.5)


@contextlib.contextmanager
def relaylm_server(
    label: str, redis_url: str, gguf: Path, timings: dict[str, float], speculative: str = "ngram"
) -> Iterator[Server]:
    """The API and one worker on the GGUF, with its default settings but ``speculative``."""
    stack = Stack(redis_url=redis_url, log_dir=Path(tempfile.mkdtemp(prefix="relaylm-moe-")))
    try:
        stack.start_api(log_level="WARNING")
        process = _timed(
            f"{label}: worker start (load + self-test)",
            timings,
            lambda: stack.start_worker(str(gguf), SERVED_NAME, log_level="WARNING", speculative=speculative),
        )
        wait_for_compiled_decode(stack)  # no-op under --deterministic on: the one-row step stays eager
        pid = process.popen.pid
        after_load = vm_rss_bytes(pid)
        print(f"  {label}: worker VmRSS after load: {(after_load or 0) / 2**30:.2f} GiB", flush=True)
        facts = {"rss_after_load_bytes": after_load, "worker_log": str(process.log_path)}
        yield Server(label, stack.base_url, SERVED_NAME, pid, facts)
    finally:
        stack.stop()


@contextlib.contextmanager
def llama_server(gguf: Path, args: argparse.Namespace, timings: dict[str, float]) -> Iterator[Server]:
    """llama-server on the GGUF, a slot per stream, every core."""
    binary = llama_server_peer.find_llama_server()
    if binary is None:
        raise SystemExit("no llama-server: `make llama-server` builds one")
    args.llama_server_version = llama_server_peer.version(binary)
    threads = len(os.sched_getaffinity(0))
    slots = max(args.streams)
    context = args.prompt_tokens + args.output_tokens + 64
    began = time.monotonic()
    with llama_server_peer.running_llama_server(binary, gguf, slots, context, threads) as url:
        timings["llama-server start"] = round(time.monotonic() - began, 1)
        pid = child_pid("llama-server")
        after_load = vm_rss_bytes(pid) if pid else None
        yield Server("llama-server", url, "peer", pid, {"rss_after_load_bytes": after_load, "slots": slots})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,32", help="comma-separated concurrent stream counts")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["both", "relaylm", "llama-server"], default="both")
    parser.add_argument(
        "--speculative-off-row",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="relaylm once more with --speculative off (a random model's greedy text repeats itself, which "
        "n-gram drafts feed on more than a real model's would)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "moe.json")
    parser.add_argument("--gguf", type=Path, default=None, help="another Qwen3(-MoE) GGUF instead of the built one")
    args = parser.parse_args()
    args.streams = [int(count) for count in args.streams.split(",")]
    timings: dict[str, float] = {}
    began = time.monotonic()

    from transformers import AutoTokenizer

    if args.gguf:
        checkpoint, gguf = Path("/nonexistent"), args.gguf
    else:
        checkpoint, gguf = make_gguf(timings)
    counts = parameter_counts(checkpoint) if checkpoint.is_dir() else None
    if counts:
        print(
            f"  parameters: {counts['total'] / 1e9:.3f} B, {counts['active_per_token'] / 1e9:.3f} B active", flush=True
        )
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    texts = distinct_prompts(tokenizer, max(args.streams), args.prompt_tokens)

    binary = find_redis_server()
    own = start_redis(binary) if binary else None
    redis_url = own.url if own else os.environ.get("RELAYLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        with contextlib.ExitStack() as running:
            servers = []
            if args.only in ("both", "relaylm"):
                servers.append(running.enter_context(relaylm_server("relaylm", redis_url, gguf, timings)))
                if args.speculative_off_row:
                    label = "relaylm --speculative off"
                    servers.append(running.enter_context(relaylm_server(label, redis_url, gguf, timings, "off")))
            if args.only in ("both", "llama-server"):
                servers.append(running.enter_context(llama_server(gguf, args, timings)))
            systems = _timed("runs", timings, lambda: measure(servers, texts, args))
    finally:
        if own:
            own.stop()
    file_bytes = gguf.stat().st_size

    ratios: dict[str, dict[str, dict[str, float]]] = {}  # relaylm row → streams → ratio of each rate
    if "llama-server" in systems:
        for name in (name for name in systems if name.startswith("relaylm")):
            for streams in map(str, args.streams):
                ours, peer = systems[name]["by_streams"][streams], systems["llama-server"]["by_streams"][streams]
                ratios.setdefault(name, {})[streams] = {
                    "decode_tok_s": ours["decode_tok_s"] / peer["decode_tok_s"],
                    "output_tok_s": ours["output_tok_s"] / peer["output_tok_s"],
                }

    timings["total"] = round(time.monotonic() - began, 1)

    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(["python -m bench.moe_bench", *sys.argv[1:]]),
        "model": {"shape": SHAPE, "seed": SEED, "parameters": counts, "checkpoint": str(checkpoint)}
        if not args.gguf
        else None,
        "gguf": {"path": str(gguf), "type": "Q4_K_M", "bytes": file_bytes},
        "llama_server": getattr(args, "llama_server_version", None),
        "relaylm_worker_settings": "defaults (--deterministic on, --speculative ngram); the other row speculative off",
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "rounds": args.rounds,
        "systems": systems,
        "ratios_relaylm_over_llama_server": ratios,
        "rss_over_gguf_bytes": {
            name: (result["rss_while_serving"] or {}).get("max_bytes", 0) / file_bytes
            for name, result in systems.items()
        },
        "timings_s": timings,
    }
    print_tables(report)
    write_result(args.out, report)


def print_tables(report: dict[str, Any]) -> None:
    """The rates and the resident memory, from a report (``main``'s, or bench/results/moe.json's)."""
    systems, ratios, file_bytes = report["systems"], report["ratios_relaylm_over_llama_server"], report["gguf"]["bytes"]
    print()
    print(
        f"{Path(report['gguf']['path']).name}: {file_bytes / 2**30:.2f} GiB; {report['prompt_tokens']} prompt "
        f"tokens, {report['output_tokens']} out; median of {report['rounds']} rounds"
    )
    print(
        "| system | streams | decode tok/s | Σ streams' decode tok/s | output tok/s (wall) | TTFT p50 ms "
        "| relaylm ÷ llama-server (decode) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, result in systems.items():
        for streams, row in result["by_streams"].items():
            ratio = f"{ratios[name][streams]['decode_tok_s']:.2f}" if name in ratios else "—"
            print(
                f"| {name} | {streams} | {row['decode_tok_s']:.1f} | {row['sum_of_stream_decode_tok_s']:.1f} | "
                f"{row['output_tok_s']:.1f} | {row['ttft_p50_ms']:.0f} | {ratio} |"
            )
    print()
    print("| process | VmRSS after load | VmRSS max while serving | max ÷ GGUF file size |")
    print("|---|---:|---:|---:|")
    for name, result in systems.items():
        load, serving = result["rss_after_load_bytes"], (result["rss_while_serving"] or {}).get("max_bytes")
        shown = [f"{value / 2**30:.2f} GiB" if value else "—" for value in (load, serving)]
        print(f"| {name} | {shown[0]} | {shown[1]} | {(serving or 0) / file_bytes:.2f} |")


if __name__ == "__main__":
    main()
