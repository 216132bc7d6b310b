"""A 4-bit GGUF's own quantization groups, kept beside the converted checkpoint so that
``--quantization int4`` multiplies by the file's exact weights instead of re-quantizing their
dequantized copy.

Re-quantizing is lossy twice over: a Q4_1 group dequantized to floats and quantized again onto a
new min/max grid lands between the file's levels (measured on the default model: +6.5 %
perplexity). But Q4_0, Q4_1 and Q4_K all store groups of 32 weights as ``scale * q + min`` with
``q`` in 0..15, which is exactly the layout torch's int4 CPU kernel reads. So the groups are read
from the GGUF blocks, matched to the converted weights row by row (transformers reorders the rows
of some projections, e.g. Llama's q/k for its rotary layout), and kept only where
``scale * q + min`` reproduces the converted weight bit for bit.

Stored as one safetensors file of ``{weight}.q4`` (uint8, two values a byte, low nibble first),
``{weight}.group_scale`` and ``{weight}.group_min`` (float32, one per 32 inputs) per weight, and
for a Q4_K weight the factors they are products of (``SuperScales``: ``{weight}.d``, ``.sc``,
``.neg_dmin``, ``.m``), which the exact kernels read as they are, in fewer bytes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from worker.native import exact

logger = logging.getLogger(__name__)

GROUPS_FILE = "gguf_int4_groups.safetensors"
GROUP_SIZE = 32

# GGUF tensor names of Llama-style decoders (Llama, Qwen2, Qwen3, Mistral) and the weights
# transformers converts them into.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


_FACTOR_FIELDS = ("d", "sc", "neg_dmin", "m")  # SuperScales' fields, in order


@dataclass(frozen=True)
class SuperScales:
    """A Q4_K weight's group scales and mins as its file stores them: per super-block of
    ``exact.SUPER_GROUPS`` groups a float16 ``d`` and ``dmin``, per group a 6-bit ``sc`` and ``m``, with
    ``group_scale = d * sc`` and ``group_min = -dmin * m`` (both products exact in float32)."""

    d: torch.Tensor  # float32 [out, in / (GROUP_SIZE * exact.SUPER_GROUPS)], each a float16 value
    sc: torch.Tensor  # uint8 [out, in / GROUP_SIZE], each 0..63
    neg_dmin: torch.Tensor  # float32, as d: -dmin
    m: torch.Tensor  # uint8, as sc

    @classmethod
    def joined(cls, parts: list[SuperScales]) -> SuperScales:
        return cls(*(torch.cat([getattr(p, field) for p in parts]) for field in _FACTOR_FIELDS))

    def permute_rows(self, order: torch.Tensor) -> SuperScales:
        return SuperScales(self.d[order], self.sc[order], self.neg_dmin[order], self.m[order])


@dataclass(frozen=True)
class Int4Groups:
    """One weight as ``group_scale * q + group_min`` per group of ``GROUP_SIZE`` inputs;
    ``factors``: the same scales and mins as the file's Q4_K factors them (None: not Q4_K)."""

    values: torch.Tensor  # uint8 [out, in], each 0..15
    group_scale: torch.Tensor  # float32 [out, in / GROUP_SIZE]
    group_min: torch.Tensor  # float32 [out, in / GROUP_SIZE]
    factors: SuperScales | None = None

    def dequantize(self) -> torch.Tensor:
        out, width = self.values.shape
        grouped = self.values.float().view(out, width // GROUP_SIZE, GROUP_SIZE)
        return (grouped * self.group_scale[..., None] + self.group_min[..., None]).view(out, width)

    @classmethod
    def joined(cls, parts: list[Int4Groups]) -> Int4Groups:
        """Several weights' groups stacked in row order (a joined projection's)."""
        factors = [p.factors for p in parts if p.factors is not None]
        return cls(
            values=torch.cat([p.values for p in parts]),
            group_scale=torch.cat([p.group_scale for p in parts]),
            group_min=torch.cat([p.group_min for p in parts]),
            factors=SuperScales.joined(factors) if len(factors) == len(parts) else None,
        )

    def permute_rows(self, order: torch.Tensor) -> Int4Groups:
        factors = None if self.factors is None else self.factors.permute_rows(order)
        return Int4Groups(self.values[order], self.group_scale[order], self.group_min[order], factors)

    def pack(self) -> exact.PackedWeight:
        """In the exact kernels' layout: Q4_K's scales as the file factors them, else as products."""
        factors = self.factors
        if factors is not None:
            return exact.pack_int4_factored(self.values, factors.d, factors.sc, factors.neg_dmin, factors.m)
        return exact.pack_int4(self.values, self.group_scale, self.group_min)


def hf_weight_name(gguf_name: str) -> str | None:
    """The transformers weight a GGUF tensor becomes, for the projections int4 packs."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a group -> 32 values: low nibbles are inputs 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, ...] | None]


def _q4_0(blocks: np.ndarray) -> _Decoded:
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return _nibbles(blocks[:, 2:]), scale, -8 * scale, None


def _q4_1(blocks: np.ndarray) -> _Decoded:
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    low = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return _nibbles(blocks[:, 4:]), scale, low, None


def _q4_k(blocks: np.ndarray) -> _Decoded:
    """Super-blocks of 256: fp16 ``d`` and ``dmin``, eight 6-bit scales and mins packed in 12
    bytes, then 128 bytes whose 32-byte quarters hold sub-blocks 2j (low nibbles) and 2j+1."""
    count = blocks.shape[0]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16].reshape(count, 3, 4)
    first, second, third = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 2) & 0x30)], axis=-1)
    quarters = blocks[:, 16:].reshape(count, 4, 1, 32)
    values = ((quarters >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(count * 8, 32)
    group_scale = (d * scales.astype(np.float32)).reshape(count * 8, 1)
    group_min = -(dmin * mins.astype(np.float32)).reshape(count * 8, 1)
    return values, group_scale, group_min, (d, scales, -dmin, mins)


_DECODERS = {"Q4_0": (_q4_0, 18), "Q4_1": (_q4_1, 20), "Q4_K": (_q4_k, 144)}


def read_groups(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Groups | None:
    """A GGUF tensor's groups (``shape`` is [out, in]), or None for a type that is not 4-bit."""
    if type_name not in _DECODERS:
        return None
    decode, block_bytes = _DECODERS[type_name]
    out, width = shape
    values, scale, low, factored = decode(np.ascontiguousarray(raw).reshape(-1, block_bytes))
    factors = None
    if factored is not None:
        d, sc, neg_dmin, m = factored
        supers = width // (GROUP_SIZE * exact.SUPER_GROUPS)
        factors = SuperScales(
            d=torch.from_numpy(np.ascontiguousarray(d)).reshape(out, supers),
            sc=torch.from_numpy(np.ascontiguousarray(sc, dtype=np.uint8)).reshape(out, width // GROUP_SIZE),
            neg_dmin=torch.from_numpy(np.ascontiguousarray(neg_dmin)).reshape(out, supers),
            m=torch.from_numpy(np.ascontiguousarray(m, dtype=np.uint8)).reshape(out, width // GROUP_SIZE),
        )
    return Int4Groups(
        values=torch.from_numpy(values.astype(np.uint8)).reshape(out, width),
        group_scale=torch.from_numpy(scale).reshape(out, width // GROUP_SIZE),
        group_min=torch.from_numpy(low).reshape(out, width // GROUP_SIZE),
        factors=factors,
    )


def _row_order(groups: Int4Groups, weight: torch.Tensor) -> torch.Tensor | None:
    """The permutation taking the GGUF's rows to the converted weight's, when every row matches exactly."""
    position = {row.numpy().tobytes(): index for index, row in enumerate(groups.dequantize())}
    try:
        order = [position[row.numpy().tobytes()] for row in weight.float()]
    except KeyError:
        return None
    return torch.tensor(order) if len(set(order)) == len(order) else None


def extract_int4_groups(gguf_path: Path, checkpoint: dict[str, torch.Tensor]) -> dict[str, Int4Groups]:
    """Every projection of ``checkpoint`` (the converted float32 weights) that the GGUF stores
    in a 4-bit type and that ``scale * q + min`` reproduces exactly."""
    from gguf import GGUFReader

    found: dict[str, Int4Groups] = {}
    for tensor in GGUFReader(str(gguf_path)).tensors:
        name = hf_weight_name(tensor.name)
        weight = checkpoint.get(name) if name else None
        if name is None or weight is None or weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
            continue
        groups = read_groups(tensor.data, tensor.tensor_type.name, (weight.shape[0], weight.shape[1]))
        if groups is None:
            continue
        order = _row_order(groups, weight)
        if order is None:
            logger.warning("%s: the GGUF's %s groups do not reproduce the converted weight; not kept", name,
                           tensor.tensor_type.name)  # fmt: skip
            continue
        found[name] = groups.permute_rows(order)
    return found


def save_groups(groups: dict[str, Int4Groups], path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for name, group in groups.items():
        tensors[f"{name}.q4"] = (group.values[:, 0::2] | (group.values[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.group_scale"] = group.group_scale.contiguous()
        tensors[f"{name}.group_min"] = group.group_min.contiguous()
        if group.factors is not None:
            for field in _FACTOR_FIELDS:
                tensors[f"{name}.{field}"] = getattr(group.factors, field).contiguous()
    save_file(tensors, str(path))


def load_groups(folder: Path) -> dict[str, Int4Groups]:
    """The groups kept beside a converted checkpoint; empty when it has none (not from a 4-bit GGUF)."""
    path = folder / GROUPS_FILE
    if not path.is_file():
        return {}
    tensors = load_file(str(path))
    groups: dict[str, Int4Groups] = {}
    for key, packed in tensors.items():
        if not key.endswith(".q4"):
            continue
        name = key.removesuffix(".q4")
        values = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        factors = None
        if all(f"{name}.{field}" in tensors for field in _FACTOR_FIELDS):  # files written before have none
            factors = SuperScales(*(tensors[f"{name}.{field}"] for field in _FACTOR_FIELDS))
        groups[name] = Int4Groups(values, tensors[f"{name}.group_scale"], tensors[f"{name}.group_min"], factors)
    return groups
