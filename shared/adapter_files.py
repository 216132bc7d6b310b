"""LoRA adapters in PEFT's format (``adapter_config.json`` and ``adapter_model.safetensors``),
read without torch: the config, and the tensors' names and shapes from the safetensors header.
The API checks an adapter with it before storing one; workers read the same way, then load the
tensors.

Only what relaylm serves is accepted, and anything else is refused by the field that asks for
it: plain LoRA (no DoRA, no bias, no modules saved whole, one alpha) on the
decoder layers' seven projections. Ranks are read from the tensors (PEFT's ``rank_pattern``
gives targets ranks of their own; the tensors say what they are).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = frozenset(TARGETS[:4])
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(
    r"^base_model\.model\.(?P<body>.*?)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<target>[a-z_]+)\.lora_(?P<part>[AB])\.weight$"
)
_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})


class AdapterError(ValueError):
    """An adapter relaylm cannot serve; ``field`` names what says so (a config field or a file)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class LoraConfig:
    rank: int  # the config's ``r``
    alpha: float
    rslora: bool
    targets: frozenset[str]  # empty where ``target_modules`` is a regex: the tensors say

    def scaling(self, rank: int) -> float:
        """PEFT's scaling of an update of ``rank``: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
        return self.alpha / math.sqrt(rank) if self.rslora else self.alpha / rank


@dataclass(frozen=True)
class Update:
    """One projection's update as the files hold it: ``lora_A`` ``[rank, in]``, ``lora_B`` ``[out, rank]``."""

    a_key: str
    b_key: str
    rank: int
    in_features: int
    out_features: int


def _refuse_set(config: dict[str, Any], name: str, what: str) -> None:
    value = config.get(name)
    if value not in (None, False, "none", [], {}):
        raise AdapterError(name, f"{what} is not served (found {value!r})")


def read_config(data: bytes) -> LoraConfig:
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(CONFIG_FILE, f"not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(CONFIG_FILE, "not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError("peft_type", f"{peft_type} adapters are not served, only LORA")
    _refuse_set(config, "use_dora", "DoRA")
    _refuse_set(config, "bias", "a trained bias")
    _refuse_set(config, "modules_to_save", "a module saved whole")
    _refuse_set(config, "fan_in_fan_out", "a transposed (Conv1D) layout")
    _refuse_set(config, "alpha_pattern", "a per-module alpha")
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError("r", f"must be a positive integer, not {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError("lora_alpha", f"must be a number, not {alpha!r}")
    raw = config.get("target_modules")
    if raw is None:
        raise AdapterError("target_modules", "missing")
    if not isinstance(raw, str | list):
        raise AdapterError("target_modules", f"must be a list of module names or a regex, not {raw!r}")
    targets: frozenset[str] = frozenset()
    if isinstance(raw, list):  # a string is a regex over module paths: the tensors say what it named
        targets = frozenset(str(name).rsplit(".", 1)[-1] for name in raw)
        unknown = sorted(targets - set(TARGETS))
        if unknown:
            raise AdapterError("target_modules", f"{', '.join(unknown)} not among {', '.join(TARGETS)}")
    return LoraConfig(rank, float(alpha), bool(config.get("use_rslora")), targets)


def tensor_shapes(weights: bytes) -> dict[str, list[int]]:
    """Each tensor's shape, from the safetensors header (8 bytes of length, then JSON)."""
    if len(weights) < 8:
        raise AdapterError(WEIGHTS_FILE, "not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", weights[:8])
    if length > len(weights) - 8:
        raise AdapterError(WEIGHTS_FILE, "not a safetensors file (its header runs past the end)")
    try:
        header = json.loads(weights[8 : 8 + length])
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(WEIGHTS_FILE, f"not a safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise AdapterError(WEIGHTS_FILE, "not a safetensors file (its header is not an object)")
    shapes: dict[str, list[int]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _FLOATS or len(entry.get("shape", [])) != 2:
            raise AdapterError(WEIGHTS_FILE, f"tensor {key} is not a 2-D float matrix")
        shapes[key] = [int(size) for size in entry["shape"]]
    return shapes


def updates(config: LoraConfig, shapes: dict[str, list[int]]) -> dict[tuple[int, str], Update]:
    """The updates by ``(layer, target)``; ``AdapterError`` for a tensor that is not one."""
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        match = _KEY.match(key)
        if match is None or match["target"] not in TARGETS:
            raise AdapterError(WEIGHTS_FILE, f"tensor {key} is not a LoRA update of a decoder projection")
        if config.targets and match["target"] not in config.targets:
            raise AdapterError("target_modules", f"tensors for {match['target']} but it is not a target")
        halves.setdefault((int(match["layer"]), match["target"]), {})[match["part"]] = key
    if not halves:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA tensor")
    found: dict[tuple[int, str], Update] = {}
    for (layer, target), keys in sorted(halves.items()):
        where = f"layers.{layer}.{target}"
        if set(keys) != {"A", "B"}:
            raise AdapterError(WEIGHTS_FILE, f"{where} has lora_{next(iter(keys))} alone")
        a, b = shapes[keys["A"]], shapes[keys["B"]]
        if a[0] != b[1]:
            raise AdapterError(WEIGHTS_FILE, f"{where}: lora_A is {a}, lora_B {b}")
        found[(layer, target)] = Update(keys["A"], keys["B"], a[0], a[1], b[0])
    return found


class ModelShapes(BaseModel):
    """What a model's projections take and give (``target`` → ``[in, out]``), which of its layers'
    MLPs are mixtures of experts, and the largest rank its workers serve: what an adapter must
    fit. Workers publish it in their registry record."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    sparse_layers: list[int] = Field(default_factory=list)
    max_rank: int = 64


def check_fits(found: dict[tuple[int, str], Update], model: ModelShapes) -> None:
    """``AdapterError`` naming the field where the adapter does not fit ``model``."""
    sparse = set(model.sparse_layers)
    for (layer, target), update in found.items():
        where = f"layers.{layer}.{target}"
        if update.rank > model.max_rank:
            raise AdapterError(
                "r", f"rank {update.rank} ({where}) is over this server's --max-lora-rank {model.max_rank}"
            )
        if layer >= model.num_layers:
            raise AdapterError(WEIGHTS_FILE, f"{where}: the model has {model.num_layers} layers")
        if target not in ATTENTION_TARGETS and layer in sparse:
            raise AdapterError("target_modules", f"{where}: the layer's MLP is a mixture of experts")
        expected_in, expected_out = model.shapes[target]
        if (update.in_features, update.out_features) != (expected_in, expected_out):
            raise AdapterError(
                WEIGHTS_FILE,
                f"{where} maps {update.in_features} to {update.out_features} features; the model's maps "
                f"{expected_in} to {expected_out} (an adapter of another base model)",
            )


def read_adapter(config_data: bytes, weights: bytes) -> tuple[LoraConfig, dict[tuple[int, str], Update]]:
    """The config and the updates of an adapter's two files (``AdapterError`` for what is not served)."""
    config = read_config(config_data)
    return config, updates(config, tensor_shapes(weights))
