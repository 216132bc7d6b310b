"""How a generation engine runs, decided once from the model, the machine and the settings.

Each variant below exists because a model or a machine needs it, not for a comparison: the
library forward for checkpoints the native decoder does not read, full-length slots where memory
cannot follow the tokens (CUDA), prefixes copied into each slot where attention must read one
contiguous row (the exact numerics). The engine, scheduler and sampler read the plan; nothing
else in the engine decides a variant.

A benchmark may ask for an older variant (``kv_layout="slots"``, ``share_prefixes=False`` on
``EngineConfig``) to measure what the current one gains; the plan honours that where it can."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from worker.native.decoder import NativeCausalLM
from worker.native.kv_cache import is_lazily_backed

Forward = Literal["native", "transformers"]
Numerics = Literal["exact", "library"]
KVLayout = Literal["tokens", "slots"]
PrefixPolicy = Literal["shared", "copy", "off"]
Speculation = Literal["ngram", "off"]


@dataclass(frozen=True)
class ExecutionPlan:
    forward: Forward  # relaylm's decoder, or the transformers model (--model-impl)
    numerics: Numerics  # exact: the fixed-order kernels of --deterministic on
    kv_layout: KVLayout  # tokens: a slot takes memory for the tokens it holds; slots: full length
    prefix_policy: PrefixPolicy  # shared: held once and read in place; copy: copied into each slot
    compiled_step: bool  # one stream's decode step compiled ahead of time
    # ngram: decoding sequences draft from their own tokens, verified in the step (drafter.py)
    speculation: Speculation = "off"

    @property
    def is_exact(self) -> bool:
        return self.numerics == "exact"

    def describe(self) -> str:
        return (
            f"forward {self.forward}, numerics {self.numerics}, KV held by {self.kv_layout}, "
            f"prefixes {self.prefix_policy}, compiled step {'on' if self.compiled_step else 'off'}, "
            f"speculation {self.speculation}"
        )


def resolve_plan(
    model: torch.nn.Module,
    device: torch.device,
    prefix_cache_bytes: int,
    kv_layout: Literal["auto", "slots"] = "auto",
    share_prefixes: bool = True,
    compiled_step: bool = False,
    speculation: Speculation = "off",
) -> ExecutionPlan:
    """``compiled_step``: asked for and buildable here (a native CPU model, library numerics,
    a C++ compiler); the plan refuses it elsewhere. ``speculation``: asked for; the plan keeps it
    with the exact numerics only, where a drafted position's logits are bit for bit those of a
    step of its own, so verification cannot change the text (the library's kernels give a
    k-row forward other bits than k one-row ones)."""
    native = isinstance(model, NativeCausalLM)
    exact = native and model.deterministic
    # A mixture of experts' step branches on the router's choice: no one graph to compile.
    sparse = isinstance(model, NativeCausalLM) and model.config.moe is not None
    layout: KVLayout = "tokens" if kv_layout == "auto" and is_lazily_backed(device) else "slots"
    prefix: PrefixPolicy = "off"
    if prefix_cache_bytes > 0:
        # Attention over a prefix held apart is two softmaxes joined: other bits than one softmax
        # over the keys of a cold prefill, so the exact numerics copy the prefix instead.
        shared = share_prefixes and native and not exact and layout == "tokens"
        prefix = "shared" if shared else "copy"
    return ExecutionPlan(
        forward="native" if native else "transformers",
        numerics="exact" if exact else "library",
        kv_layout=layout,
        prefix_policy=prefix,
        compiled_step=compiled_step and native and not exact and device.type == "cpu" and not sparse,
        speculation=speculation if exact else "off",
    )
