"""LoRA adapters in PEFT's format (``adapter_config.json`` and ``adapter_model.safetensors``):
read, and checked against the model they would be served on.

Only what relaylm serves is accepted, and anything else is refused by the field that asks for it:
plain LoRA (no DoRA, no bias, no modules saved whole) on the decoder layers' seven projections,
one rank and one alpha for every target (or per-target ranks PEFT writes as ``rank_pattern``: the
tensors' own shapes are what is served, so those are read from the tensors).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = frozenset(TARGETS[:4])
_KEY = re.compile(
    r"^base_model\.model\.(?P<body>.*?)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<target>[a-z_]+)\.lora_(?P<part>[AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter relaylm cannot serve; ``field`` names what says so (a config field or a tensor)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class LoraPair:
    """One projection's low-rank update ``W + scaling * B @ A``: ``a`` ``[rank, in]``, ``b`` ``[out, rank]`` (fp32)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter's updates by ``(layer, target)``, as read."""

    rank: int  # the config's ``r``
    targets: frozenset[str]
    pairs: dict[tuple[int, str], LoraPair]
    base_model: (
        str | None
    )  # the config's ``base_model_name_or_path``, as written (not checked: a path on the trainer's machine)

    @property
    def num_parameters(self) -> int:
        return sum(pair.a.numel() + pair.b.numel() for pair in self.pairs.values())


def _field(config: dict[str, Any], name: str, default: Any = None) -> Any:
    return config.get(name, default)


def _refuse_set(config: dict[str, Any], name: str, what: str) -> None:
    value = config.get(name)
    if value not in (None, False, "none", [], {}):
        raise AdapterError(name, f"{what} is not served (found {value!r})")


def _targets(config: dict[str, Any]) -> frozenset[str]:
    raw = _field(config, "target_modules")
    if raw is None:
        raise AdapterError("target_modules", "missing")
    if isinstance(raw, str):  # a regex over module paths: what it names is read from the tensors
        return frozenset()
    names = frozenset(str(name).rsplit(".", 1)[-1] for name in raw)
    unknown = sorted(names - set(TARGETS))
    if unknown:
        raise AdapterError("target_modules", f"{', '.join(unknown)} not among {', '.join(TARGETS)}")
    return names


def read_peft(config_json: bytes, weights: bytes) -> PeftAdapter:
    """Parse an adapter; ``AdapterError`` for anything relaylm does not serve."""
    try:
        config = json.loads(config_json)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError("adapter_config.json", f"not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError("adapter_config.json", "not a JSON object")
    peft_type = str(_field(config, "peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError("peft_type", f"{peft_type} adapters are not served, only LORA")
    _refuse_set(config, "use_dora", "DoRA")
    _refuse_set(config, "bias", "a trained bias")
    _refuse_set(config, "modules_to_save", "a module saved whole")
    _refuse_set(config, "fan_in_fan_out", "a transposed (Conv1D) layout")
    _refuse_set(config, "alpha_pattern", "a per-module alpha")
    rank = _field(config, "r")
    alpha = _field(config, "lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError("r", f"must be a positive integer, not {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError("lora_alpha", f"must be a number, not {alpha!r}")
    targets = _targets(config)
    try:
        tensors = load_safetensors(weights)
    except Exception as exc:  # safetensors raises its own error types (and OSError) for a bad file
        raise AdapterError("adapter_model.safetensors", f"not a safetensors file ({exc})") from exc
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match["target"] not in TARGETS:
            raise AdapterError(
                "adapter_model.safetensors", f"tensor {key} is not a LoRA update of a decoder projection"
            )
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise AdapterError("adapter_model.safetensors", f"tensor {key} is not a 2-D float matrix")
        halves.setdefault((int(match["layer"]), match["target"]), {})[match["part"]] = tensor.float()
    if not halves:
        raise AdapterError("adapter_model.safetensors", "holds no LoRA tensor")
    pairs: dict[tuple[int, str], LoraPair] = {}
    for (layer, target), parts in sorted(halves.items()):
        where = f"layers.{layer}.{target}"
        if set(parts) != {"A", "B"}:
            raise AdapterError("adapter_model.safetensors", f"{where} has lora_{next(iter(parts))} alone")
        a, b = parts["A"], parts["B"]
        if a.shape[0] != b.shape[1]:
            raise AdapterError(
                "adapter_model.safetensors", f"{where}: lora_A is {list(a.shape)}, lora_B {list(b.shape)}"
            )
        pair_rank = int(a.shape[0])
        scale = alpha / math.sqrt(pair_rank) if config.get("use_rslora") else alpha / pair_rank
        if targets and target not in targets:
            raise AdapterError("target_modules", f"tensors for {target} but it is not a target")
        pairs[(layer, target)] = LoraPair(a.contiguous(), b.contiguous(), float(scale))
    found = frozenset(target for _, target in pairs)
    return PeftAdapter(rank, found, pairs, config.get("base_model_name_or_path"))


@dataclass(frozen=True)
class TargetShapes:
    """What a model's projections take and give, by target: ``(in, out)``."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    sparse_layers: frozenset[int] = frozenset()  # layers whose MLP is a mixture of experts


def check_fits(adapter: PeftAdapter, model: TargetShapes, max_rank: int) -> None:
    """``AdapterError`` naming the field where ``adapter`` does not fit ``model``."""
    for (layer, target), pair in adapter.pairs.items():
        where = f"layers.{layer}.{target}"
        if pair.rank > max_rank:
            raise AdapterError("r", f"rank {pair.rank} ({where}) is over this server's --max-lora-rank {max_rank}")
        if layer >= model.num_layers:
            raise AdapterError("adapter_model.safetensors", f"{where}: the model has {model.num_layers} layers")
        if target not in ATTENTION_TARGETS and layer in model.sparse_layers:
            raise AdapterError("target_modules", f"{where}: the layer's MLP is a mixture of experts")
        expected_in, expected_out = model.shapes[target]
        if pair.a.shape[1] != expected_in or pair.b.shape[0] != expected_out:
            raise AdapterError(
                "adapter_model.safetensors",
                f"{where} maps {pair.a.shape[1]} to {pair.b.shape[0]} features; the model's maps {expected_in} "
                f"to {expected_out} (an adapter of another base model)",
            )
