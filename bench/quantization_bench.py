"""What ``--quantization int8`` / ``int4`` cost in quality and give in speed, on the default model;
and FBGEMM's dynamic int8, which is not offered, to show why.

    python -m bench.quantization_bench [--tokens 48] [--seconds 8] [--threads N]

Quality, against the same model unquantized in the same dtype (bf16 where the CPU has it):
perplexity on a fixed passage (teacher-forced one token per decode step, as one stream runs), and
greedy agreement on a fixed prompt set (the
share of prompts whose greedy continuation is identical, and the mean share of tokens generated
before the first difference). Speed: engine decode tokens/s with 1 and 32 streams, in this
process (no API or Redis: the matmuls are what changes). Prints a table; writes
bench/results/quantization.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

import torch

from bench.in_process import InProcessEngine
from tests.support.models import default_model_dir
from worker.engine.builder import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.prefix_state import PrefixLink
from worker.engine.scheduler import PrefillChunk
from worker.engine.scheduling_state import SchedulingState
from worker.models.loader import LoadedModel, load_model
from worker.native.decoder import NativeCausalLM
from worker.native.gguf_groups import load_groups
from worker.native.kv_cache import KVCacheLayout, SlotKVCache
from worker.native.quantize import Int4Linear, Int8Linear, quantize
from worker.service.thread_budget import available_cores

RESULTS = Path(__file__).parent / "results" / "quantization.json"

# Written for this benchmark (no data set is reachable here); plain expository English.
PASSAGE = """\
A bicycle turns the push of the rider's legs into forward motion through a short chain of simple
parts. The pedals turn a crank, the crank turns the front sprocket, and the chain carries that
turning to a smaller sprocket on the rear wheel. Because the rear sprocket is smaller, one turn of
the pedals turns the wheel more than once, and the rider travels further with each stroke. Gears
change that ratio: a large rear sprocket makes climbing easier at the cost of speed, and a small
one lets a rider go fast on flat ground once the bicycle is moving.

Balance comes mostly from steering. When a moving bicycle starts to lean, the rider turns the
front wheel slightly toward the lean, and the wheels roll back under the rider's weight. The shape
of the front fork helps as well, because it makes the wheel steer into a lean by itself. This is
why a bicycle is hard to balance when it stands still and easy once it rolls.

Brakes press pads against the rim or a disc attached to the hub, turning motion into heat. The
front brake does most of the stopping, because braking shifts the rider's weight forward onto the
front wheel. Tyres filled with air soften the ride and grip the road; too little pressure makes
them slow and prone to punctures, and too much makes the ride harsh and the grip poor.
"""

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a prime number is in one sentence.",
    "Give me three tips for writing clean Python code.",
    "What does HTTP stand for?",
    "Translate 'good morning' into Spanish.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How many legs does a spider have?",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water at sea level?",
    "Name three planets in the solar system.",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot.",
    "What is 12 times 12?",
    "Describe a cat to someone who has never seen one.",
    "List two benefits of regular exercise.",
]


class _Chunk:
    """The one prompt chunk the runner is given: the passage's first token, in slot 0."""

    def __init__(self, token_ids: list[int]) -> None:
        self.sched = SchedulingState(token_ids, slot=0)
        self.prefix = PrefixLink()  # it reads no shared prompt prefix


def perplexity(loaded: LoadedModel, text: str) -> float:
    """Teacher-forced, one token per decode step: the path a single stream takes (one-row matmuls)."""
    assert isinstance(loaded.model, NativeCausalLM)
    ids = loaded.tokenizer.encode(text)
    layout = KVCacheLayout.from_config(loaded.model.config, loaded.model.dtype, torch.device("cpu"))
    runner = ModelRunner(loaded.model, SlotKVCache(layout, 1, len(ids)))
    with torch.inference_mode():
        logits = [runner.prefill([PrefillChunk(_Chunk(ids[:1]), 0, 1)])[0]]  # type: ignore[arg-type]
        logits += [runner.decode([token], [position])[0] for position, token in enumerate(ids[1:-1], start=1)]
    nll = torch.nn.functional.cross_entropy(torch.stack(logits).float(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


class _FbgemmDynamicLinear(torch.nn.Module):
    """The rejected alternative, measured so that the rejection stays checkable: FBGEMM's dynamic
    int8 linear (per-channel int8 weights, each input quantized per tensor to 7 bits)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        full = weight.detach().float()
        scales = (full.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # quantized tensor constructors warn of a future removal
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(full, scales, torch.zeros(len(scales), dtype=torch.long), 0,
                                                 torch.qint8)  # fmt: skip
        self._packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed, True).to(x.dtype)


def _fbgemm_dynamic(model: NativeCausalLM) -> None:
    """Every packed matmul of an int8-quantized model replaced by the FBGEMM dynamic one, at any row count."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                setattr(parent, name, _FbgemmDynamicLinear(child.weight, child.bias))


def greedy(loaded: LoadedModel, prompts: list[str], tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation, through the engine (its KV cache), one prompt at a time."""
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, max_model_len=1024, kv_cache_bytes=2**28)
    engine = InProcessEngine(loaded, config)
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0}
        for prompt in prompts
    ]
    outputs = [trace.token_ids for trace in engine.run_sequential(bodies)]
    engine.close()
    return outputs


def decode_speed(loaded: LoadedModel, streams: int, seconds: float) -> float:
    config = EngineConfig(max_num_seqs=max(streams, 1), max_num_batched_tokens=512, max_model_len=1024,
                          kv_cache_bytes=2**30)  # fmt: skip
    engine = InProcessEngine(loaded, config)
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 64,
         "ignore_eos": True, "temperature": 0}
        for i in range(streams)
    ]  # fmt: skip
    engine.run(bodies)  # warm-up
    tokens, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        engine.run(bodies)
        tokens += 64 * streams
    return tokens / (time.perf_counter() - started)


# What each row loads: the offered modes by their flag; the rest built by hand, to show why they
# are not offered (or not the default).
VARIANTS = (
    "none",
    "auto (default: int4, the GGUF's groups)",
    "int8",
    "int4 re-quantized (no GGUF groups)",
    "int4 with an int4 head (not offered)",
    "fbgemm-dynamic (not offered)",
)


def _load_variant(folder: Path, variant: str) -> LoadedModel:
    flag = variant.split(" ", 1)[0]
    if flag in ("none", "auto", "int8"):
        return load_model(str(folder), Path("/nonexistent"), "cpu", "auto", 1024, "native", flag)  # type: ignore[arg-type]
    loaded = load_model(str(folder), Path("/nonexistent"), "cpu", "auto", 1024, "native", "none")
    model = loaded.model
    assert isinstance(model, NativeCausalLM)
    if flag == "fbgemm-dynamic":
        quantize(model, "int8")
        _fbgemm_dynamic(model)
    elif variant.startswith("int4 re-quantized"):
        quantize(model, "int4", groups={})  # what a safetensors checkpoint (no GGUF) gets
    else:
        quantize(model, "int4", groups=load_groups(folder))
        head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.head = Int4Linear(head, None, model.dtype)
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--seconds", type=float, default=8.0, help="decode time per speed point")
    parser.add_argument("--threads", type=int, default=available_cores(),
                        help="torch threads (default: the cores available, as one worker uses them)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = default_model_dir()
    rows = []
    reference: list[list[int]] | None = None
    for mode in VARIANTS:
        loaded = _load_variant(folder, mode)
        dtype = str(loaded.model.dtype).removeprefix("torch.")
        outputs = greedy(loaded, PROMPTS, args.tokens)
        if reference is None:
            reference = outputs
        same = [a == b for a, b in zip(outputs, reference, strict=True)]
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            / max(len(b), 1)
            for a, b in zip(outputs, reference, strict=True)
        ]
        row = {
            "quantization": mode,
            "dtype": dtype,
            "perplexity": perplexity(loaded, PASSAGE),
            "greedy_identical": sum(same) / len(same),
            "greedy_prefix_share": sum(prefix) / len(prefix),
            "decode_tok_s_1": decode_speed(loaded, 1, args.seconds),
            "decode_tok_s_32": decode_speed(loaded, 32, args.seconds),
        }
        rows.append(row)
        del loaded
    columns = [("quantization", "{:>40}"), ("dtype", "{:>9}"), ("perplexity", "{:>10.3f}"),
               ("greedy_identical", "{:>16.0%}"), ("greedy_prefix_share", "{:>19.0%}"),
               ("decode_tok_s_1", "{:>14.1f}"), ("decode_tok_s_32", "{:>15.1f}")]  # fmt: skip
    widths = [len(fmt.format(rows[0][name])) for name, fmt in columns]
    print(" ".join(name.rjust(width) for (name, _), width in zip(columns, widths, strict=True)))
    for row in rows:
        print(" ".join(fmt.format(row[name]) for name, fmt in columns))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")  # fmt: skip
    RESULTS.write_text(json.dumps({"model": folder.name, "cpu": cpu, "threads": args.threads, "tokens": args.tokens,
                                   "rows": rows}, indent=2))  # fmt: skip
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
