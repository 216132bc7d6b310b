"""relaylm's perplexity against llama.cpp's, on the same model and the same tokens.

    python -m bench.perplexity_bench [--model default|qwen2.5-coder-0.5b-instruct] [--threads N]

The passage is ``PASSAGE`` of ``bench/quantization_bench.py``. (a) llama.cpp's ``llama-perplexity``
(``make llama-server`` builds it) scores it on the GGUF that relaylm converted the model from;
(b) relaylm's native forward scores it in this process, teacher-forced one token per decode step as
``bench.quantization_bench.perplexity`` does, once per entry of ``CONFIGS``.

What llama-perplexity scores (tools/perplexity/perplexity.cpp, without ``--ppl-stride``): the text
in chunks of ``-c`` tokens, each evaluated from an empty KV cache, and of each chunk only the
predictions made from positions ``c/2 .. c-2`` (of tokens ``c/2+1 .. c-1``), so that every scored
token has at least half a chunk of context; it refuses a text of fewer than ``2c`` tokens. So it
runs with ``-c`` = the passage's token count and ``--chunks 1`` on a file holding the passage three
times: its one chunk is exactly the passage (the copies after it are never evaluated) and it
scores the passage's second half. relaylm's number here is over the same positions (``first``
below), on the token ids llama.cpp used (read back from its ``--kl-divergence-base`` file, which
also gives llama.cpp's log-probability of each scored token for the per-token column); the table
says whether relaylm's tokenizer gives the same ids, and also shows relaylm's perplexity of the
whole passage (all positions, its own tokenizer: the number ``make bench-quant`` reports).

Prints a table; writes bench/results/perplexity.json (perplexity-MODEL.json for another model; ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.quantization_bench import PASSAGE, _Chunk, perplexity
from bench.result_file import cpu_name
from tests.support.models import test_cache_dir
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import PrefillChunk
from worker.models.loader import LoadedModel, ensure_default_model, ensure_named_model, load_model, locate_default_gguf
from worker.models.named import NAMED_MODELS
from worker.native.decoder import NativeCausalLM
from worker.native.kv_cache import KVCacheLayout, SlotKVCache
from worker.native.quantize import Int4Linear, Int8Linear
from worker.service.thread_budget import available_cores
from worker.settings import DEFAULT_MODEL

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "perplexity.json"
LLAMA_PERPLEXITY = REPO_ROOT / ".cache" / "llama.cpp" / "bin" / "llama-perplexity"

# What relaylm runs: load_model's keyword arguments (quantization "auto", the serving default:
# with --deterministic on the exact kernels on the GGUF's own 4-bit groups and an 8-bit head;
# with it off, packed int4 copies for small decode batches and bf16 above).
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("deterministic=True (serving default)", {"deterministic": True, "quantization": "auto"}),
    ("deterministic=False", {"deterministic": False, "quantization": "auto"}),
    ("deterministic=False, quantization=none", {"deterministic": False, "quantization": "none"}),
]


def model_and_gguf(model: str) -> tuple[str, Path]:
    """The model's id and the GGUF relaylm converts it from (converted, or fetched, once here)."""
    if model in ("default", DEFAULT_MODEL):
        ensure_default_model(test_cache_dir())
        return DEFAULT_MODEL, locate_default_gguf()
    ensure_named_model(model, test_cache_dir())
    return model, test_cache_dir() / "gguf" / model / NAMED_MODELS[model].gguf_file


def token_nlls(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """``bench.quantization_bench.perplexity``'s computation on given ids, per token: element j is
    the negative log-likelihood of ``ids[j + 1]`` given ``ids[: j + 1]`` (the first token
    prefilled, each later one decoded alone)."""
    assert isinstance(loaded.model, NativeCausalLM)
    layout = KVCacheLayout.from_config(loaded.model.config, loaded.model.dtype, torch.device("cpu"))
    runner = ModelRunner(loaded.model, SlotKVCache(layout, 1, len(ids)))
    with torch.inference_mode():
        logits = [runner.prefill([PrefillChunk(_Chunk(ids[:1]), 0, 1)])[0]]  # type: ignore[arg-type]
        logits += [runner.decode([token], [position])[0] for position, token in enumerate(ids[1:-1], start=1)]
    return torch.nn.functional.cross_entropy(torch.stack(logits).float(), torch.tensor(ids[1:]), reduction="none")


def scored_perplexity(loaded: LoadedModel, ids: list[int], first: int = 0) -> tuple[float, torch.Tensor]:
    """Perplexity over the predictions made from positions ``first ..`` (of ``ids[first + 1 :]``),
    as llama-perplexity scores a chunk with ``first = c/2``; and those tokens' log-probabilities."""
    logp = -token_nlls(loaded, ids)[first:]
    return math.exp(-logp.mean().item()), logp


def llama_cpp_perplexity(gguf: Path, n_ctx: int, threads: int) -> dict[str, Any]:
    """llama-perplexity on the passage with one chunk of ``n_ctx`` tokens: its estimate, the token
    ids it read, the first position it scored and its log-probability of each scored token."""
    if not LLAMA_PERPLEXITY.is_file():
        sys.exit(f"{LLAMA_PERPLEXITY} is missing: build it with `make llama-server`")
    with tempfile.TemporaryDirectory() as tmp:
        text, base = Path(tmp) / "passage.txt", Path(tmp) / "logits.bin"
        text.write_text(PASSAGE * 3)  # it needs 2 * n_ctx tokens; only the first chunk is evaluated
        args = ["-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", "1",
                "-t", str(threads), "--kl-divergence-base", str(base)]  # fmt: skip
        done = subprocess.run([str(LLAMA_PERPLEXITY), *args], capture_output=True, text=True, check=False)
        found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", done.stdout + done.stderr)
        if done.returncode != 0 or found is None:
            sys.exit(f"llama-perplexity failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        # --kl-divergence-base: "_logits_", n_ctx, n_vocab, n_chunk (int32), the chunks' tokens
        # (int32), then per scored token n_vocab rounded up to even + 4 uint16: a float32 scale
        # and minimum log-probability, then each token's log-probability above that minimum in
        # steps of the scale (0: at or below the minimum, which is at most 16 below the top).
        raw = base.read_bytes()
        assert raw[:8] == b"_logits_"
        file_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8).tolist()
        assert (file_ctx, n_chunk) == (n_ctx, 1)
        tokens = np.frombuffer(raw, np.int32, n_ctx, 20).tolist()
        first = n_ctx // 2
        stride = 2 * ((n_vocab + 1) // 2) + 4
        records = np.frombuffer(raw, np.uint16, offset=20 + 4 * n_ctx).reshape(-1, stride)
        assert len(records) == n_ctx - 1 - first
        head = np.ascontiguousarray(records[:, :4]).view(np.float32)  # scale, min log-prob
        targets = np.array(tokens[first + 1 :])
        quantized = records[np.arange(len(records)), 4 + targets].astype(np.float64)
        logp = head[:, 1] + head[:, 0] * quantized
    version = subprocess.run([str(LLAMA_PERPLEXITY), "--version"], capture_output=True, text=True, check=False)
    return {
        "perplexity": float(found.group(1)),
        "plus_minus": float(found.group(2)),
        "tokens": tokens,
        "first": first,
        "logp": torch.from_numpy(logp),
        "floored": int((quantized == 0).sum()),
        "version": (version.stdout + version.stderr).strip().splitlines()[0],
        "command": shlex.join([_shown(LLAMA_PERPLEXITY), *args])
        .replace(str(gguf), _shown(gguf))
        .replace(str(text), "PASSAGE_x3.txt")
        .replace(str(base), "LOGITS.bin"),
    }


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def applied_quantization(loaded: LoadedModel) -> str:
    if isinstance(loaded.model, NativeCausalLM) and loaded.model.deterministic:
        bits = {layer.exact.down.packed.bits for layer in loaded.model.model.layers if layer.exact is not None}
        return f"exact kernels: int{min(bits)} groups, int8 head, int8 activations"
    kinds = {type(module) for module in loaded.model.modules()}
    if Int4Linear in kinds:
        return "int4, int8 head"
    return "int8" if Int8Linear in kinds else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", choices=["default", DEFAULT_MODEL, *NAMED_MODELS])
    parser.add_argument("--threads", type=int, default=available_cores(),
                        help="threads for both (default: the cores available, as one worker uses them)")  # fmt: skip
    parser.add_argument(
        "--out", type=Path, help=f"default: {RESULTS.relative_to(REPO_ROOT)} (perplexity-MODEL.json for another)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, gguf = model_and_gguf(args.model)
    out = args.out or (RESULTS if model == DEFAULT_MODEL else RESULTS.with_name(f"perplexity-{model}.json"))
    tokenizer_ids: list[int] | None = None
    llama: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = []
    for label, kwargs in CONFIGS:
        loaded = load_model(model, test_cache_dir(), "cpu", "auto", 1024, "native", **kwargs)
        if llama is None:
            tokenizer_ids = loaded.tokenizer.encode(PASSAGE)
            llama = llama_cpp_perplexity(gguf, len(tokenizer_ids), args.threads)
        value, logp = scored_perplexity(loaded, llama["tokens"], llama["first"])
        rows.append({
            "config": label,
            **kwargs,
            "quantization_applied": applied_quantization(loaded),
            "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "perplexity": value,
            "ratio_to_llama_cpp": value / llama["perplexity"],
            "mean_abs_logp_diff": (logp - llama["logp"]).abs().mean().item(),
            "max_abs_logp_diff": (logp - llama["logp"]).abs().max().item(),
            "perplexity_whole_passage": perplexity(loaded, PASSAGE),
        })  # fmt: skip
        del loaded
    assert llama is not None
    columns = [("config", "{:>40}"), ("dtype", "{:>8}"), ("quantization_applied", "{:>20}"),
               ("perplexity", "{:>10.4f}"), ("ratio_to_llama_cpp", "{:>18.4f}"),
               ("mean_abs_logp_diff", "{:>18.4f}"), ("perplexity_whole_passage", "{:>24.4f}")]  # fmt: skip
    reference = {"config": "llama.cpp llama-perplexity", "dtype": "gguf", "quantization_applied": gguf.suffixes[-2][1:],
                 "perplexity": llama["perplexity"], "ratio_to_llama_cpp": 1.0, "mean_abs_logp_diff": 0.0,
                 "perplexity_whole_passage": math.nan}  # fmt: skip
    widths = [len(fmt.format(reference[name])) for name, fmt in columns]
    print(" ".join(name.rjust(width) for (name, _), width in zip(columns, widths, strict=True)))
    for row in [reference, *rows]:
        print(" ".join(fmt.format(row[name]) for name, fmt in columns))
    n_ctx, first = len(llama["tokens"]), llama["first"]
    same_tokens = tokenizer_ids == llama["tokens"]
    print(f"{model}: passage of {n_ctx} tokens, scored: the {n_ctx - 1 - first} tokens at positions {first + 1}.."
          f"{n_ctx - 1}; relaylm's tokenizer gives {'the same' if same_tokens else 'OTHER'} ids")  # fmt: skip
    report = {
        "model": model,
        "gguf": gguf.name,
        "cpu": cpu_name(),
        "threads": args.threads,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.perplexity_bench", *sys.argv[1:]]),
        "tokens": {
            "passage": n_ctx,
            "scored_positions": [first + 1, n_ctx - 1],
            "scored": n_ctx - 1 - first,
            "relaylm_tokenizer_same_ids": same_tokens,
        },
        "llama_cpp": {
            "version": llama["version"],
            "command": llama["command"],
            "perplexity": llama["perplexity"],
            "plus_minus": llama["plus_minus"],
            "logp_at_floor": llama["floored"],
        },
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
