"""relaylm's exact kernels (``kernels/exact.cpp``): the numerics of ``--deterministic on``.

A row's result must be a function of that row alone: not of the rows beside it, the thread count,
the CPU's instruction set or the library's choice of kernel. Library kernels choose their
blocking, and with it the order of a row's floating-point sums, from all of those. These kernels
fix the order in our own code:

- **Matmuls are integer-exact.** Activations are quantized per block of 32 inputs to int8 (as
  llama.cpp's q8 activations); weights are 4-bit (a GGUF's own groups of 32) or 8-bit groups;
  a group's products are summed in int32, exact in any order; the float epilogue (group scales,
  the sum over groups) runs in one fixed sequence per output element.
- **Norms, attention and the sampler's sums** reduce in an order written in the kernel (16
  lanes and a halving tree, or key order), each row or query by one thread.
- Vector (AVX512-VNNI, AVX2) and portable code compute the same operations, so they give the same
  bits. ``scalar=True`` forces the code of a CPU without AVX512-VNNI: AVX2 for the matmul and
  attention where the CPU has it, the portable code for the rest; ``portable=True`` forces the
  plain C++ of the matmul and attention, which every CPU can run (the tests compare all of them).

The extension is compiled at first use with the C++ compiler torch's ``cpp_extension`` finds
(~30 s, once: cached by torch under ``TORCH_EXTENSIONS_DIR``, keyed by the source). Without a
compiler ``available()`` is False and the worker serves without the promise.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "exact.cpp"
GROUP = 32  # inputs per quantization group, for weights and activations alike
LANES = 16  # outputs per packed weight block
SUPER_GROUPS = 8  # groups per factored super-block (a GGUF's Q4_K: 256 inputs)

PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_MUL = 0, 1, 2
# No contraction of a * b + c into FMAs and no fast-math: the code's operations are the
# definition. OpenMP: at::parallel_for is inline, and runs on torch's thread pool only when the
# extension is built with it (libgomp.so.1 then resolves to the copy torch loaded).
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c++17", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> bool:
    """Build (once per source and torch version) and load the extension; False, logged once,
    where it cannot be built."""
    if _state.get("ok") is True:  # loaded: every matmul asks, so without taking the lock
        return True
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        try:
            from torch.utils import cpp_extension

            digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
            _state["module"] = cpp_extension.load(
                name=f"relaylm_exact_{digest}",
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=True,
                verbose=False,
            )
            _state["ok"] = True
        except Exception as exc:  # a missing compiler or headers: serve without the promise
            logger.warning("exact kernels unavailable (%s): --deterministic on cannot hold", exc)
            _state["ok"] = False
        return bool(_state["ok"])


def available() -> bool:
    return load()


def _ops() -> Any:
    """The extension's Python module."""
    module = _state.get("module")
    if module is None:
        if not load():
            raise RuntimeError("relaylm's exact kernels could not be built (see the log)")
        module = _state["module"]
    return module


def has_vector_path() -> bool:
    """Whether this CPU runs the AVX512-VNNI code (else the AVX2 or the portable code: same bits, slower)."""
    return bool(_ops().has_avx512())


def code_path() -> str:
    """What the matmul and attention run on here: "AVX512-VNNI", "AVX2" or "portable code"."""
    return str(_ops().code_path())


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out, in]`` as unsigned values ``u`` per group of 32 inputs, ``w = scale * (u -
    zero) + min`` (``mins`` None: no minimum), laid out for the kernel (see ``exact.cpp``).
    ``super_scales`` given (a GGUF's Q4_K), ``scales`` and ``mins`` are uint8 factors: a group's
    scale is ``super_scales[block, group // 8, lane] * scales[block, group, lane]``, its min
    likewise with ``super_mins`` (each product exact in float32)."""

    data: torch.Tensor  # uint8
    scales: torch.Tensor  # float32 or float16 [blocks, groups, 16]; uint8 with super_scales
    mins: torch.Tensor | None
    zero: int
    bits: int
    out_features: int
    in_features: int
    super_scales: torch.Tensor | None = None  # float32 [blocks, groups / 8, 16]
    super_mins: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scales, self.mins, self.super_scales, self.super_mins)
        return sum(part.numel() * part.element_size() for part in parts if part is not None)

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each group's scale and min as float32 ``[blocks, groups, 16]`` (min None: none)."""
        if self.super_scales is None:
            return self.scales.float(), None if self.mins is None else self.mins.float()
        scales = self.super_scales.repeat_interleave(SUPER_GROUPS, dim=1) * self.scales.float()
        if self.mins is None or self.super_mins is None:
            return scales, None
        return scales, self.super_mins.repeat_interleave(SUPER_GROUPS, dim=1) * self.mins.float()


def _blocked(values: torch.Tensor, fill: float) -> torch.Tensor:
    """``[out, groups, ...]`` padded to whole 16-output blocks: ``[blocks, 16, groups, ...]``."""
    out = values.shape[0]
    padded = -(-out // LANES) * LANES
    if padded > out:
        pad = torch.full((padded - out, *values.shape[1:]), fill, dtype=values.dtype)
        values = torch.cat([values, pad])
    return values.view(padded // LANES, LANES, *values.shape[1:])


def pack(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, zero: int, bits: int) -> PackedWeight:
    """``values`` uint8 ``[out, in]`` (0..15 for 4 bits, 0..255 for 8), ``scales``/``mins`` float32
    ``[out, ceil(in / 32)]``."""
    out_features, in_features = values.shape
    groups = -(-in_features // GROUP)
    if groups * GROUP > in_features:  # inputs past the width hold the zero point: weight 0
        pad = torch.full((out_features, groups * GROUP - in_features), zero, dtype=torch.uint8)
        values = torch.cat([values, pad], dim=1)
    quads = _blocked(values.view(out_features, groups, 8, 4), zero)  # [blocks, 16, groups, 8, 4]
    quads = quads.permute(0, 2, 3, 1, 4)  # [blocks, groups, 8 quads, 16 outputs, 4 inputs]
    if bits == 4:
        quads = quads[:, :, :4] | (quads[:, :, 4:] << 4)
    data = quads.contiguous().view(-1)
    scales, mins = _narrowest(scales.float(), None if mins is None else mins.float())
    blocked_scales = _blocked(scales, 0.0).permute(0, 2, 1).contiguous()
    blocked_mins = None if mins is None else _blocked(mins, 0.0).permute(0, 2, 1).contiguous()
    return PackedWeight(data, blocked_scales, blocked_mins, zero, bits, out_features, in_features)


def _narrowest(scales: torch.Tensor, mins: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float16 where every value is exactly one (a GGUF's Q4_0/Q4_1/Q8_0 scales are): the same
    numbers, fewer bytes for a decode step to read. Else float32."""
    parts = [scales] if mins is None else [scales, mins]
    if all(torch.equal(part.half().float(), part) for part in parts):
        return scales.half(), None if mins is None else mins.half()
    return scales, mins


def _half_up(scales: torch.Tensor) -> torch.Tensor:
    """Each scale rounded up to a float16, so no value of its group passes 127 steps."""
    halves = scales.half()
    up = torch.nextafter(halves, torch.full_like(halves, float("inf")))
    return torch.where(halves.float() < scales, up, halves)


def pack_int8(weight: torch.Tensor) -> PackedWeight:
    """Symmetric 8-bit groups of 32 as llama.cpp's Q8_0: ``scale = max|w| / 127`` rounded up to a
    float16 (so a Q8_0 weight, whose scales are float16, packs back exactly)."""
    out_features, in_features = weight.shape
    groups = -(-in_features // GROUP)
    full = weight.detach().float()
    if groups * GROUP > in_features:
        full = torch.cat([full, full.new_zeros(out_features, groups * GROUP - in_features)], dim=1)
    grouped = full.view(out_features, groups, GROUP)
    scales = _half_up(grouped.abs().amax(dim=-1) / 127.0).float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grouped / safe[..., None]).clamp(-127, 127)
    values = (q + 128).to(torch.uint8).view(out_features, groups * GROUP)[:, :in_features]
    return pack(values.contiguous(), scales, None, 128, 8)


def pack_int4(values: torch.Tensor, group_scale: torch.Tensor, group_min: torch.Tensor) -> PackedWeight:
    """4-bit groups ``scale * q + min`` (a GGUF's Q4_0 / Q4_1 / Q4_K groups, as ``Int4Groups``)."""
    return pack(values.to(torch.uint8), group_scale, group_min, 0, 4)


def pack_int4_factored(
    values: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, neg_dmin: torch.Tensor, m: torch.Tensor
) -> PackedWeight:
    """4-bit groups whose scale is ``d * sc`` and min ``neg_dmin * m``, kept factored as a GGUF's
    Q4_K stores them: ``d``/``neg_dmin`` float32 ``[out, in / 256]``, ``sc``/``m`` uint8 ``[out, in /
    32]``. 4.75 bits a weight, against 6 with a float32 scale and min per group; the kernels
    form each product, which is exact in float32, so the results are the same bits."""
    in_features = values.shape[1]
    if in_features % (GROUP * SUPER_GROUPS):
        raise ValueError(f"factored 4-bit groups need a width that is a multiple of {GROUP * SUPER_GROUPS}")
    plain = pack(values.to(torch.uint8), sc.float(), m.float(), 0, 4)

    def blocked(part: torch.Tensor) -> torch.Tensor:
        return _blocked(part, 0).permute(0, 2, 1).contiguous()

    return replace(
        plain,
        scales=blocked(sc.to(torch.uint8)),
        mins=blocked(m.to(torch.uint8)),
        super_scales=blocked(d.float()),
        super_mins=blocked(neg_dmin.float()),
    )


def matmul(
    x: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    prologue: int = PROLOGUE_NONE,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    out_float32: bool = False,
    lora: LoraRows | None = None,
    scalar: bool = False,
    portable: bool = False,
) -> torch.Tensor:
    """``residual + (prologue(x) @ W^T + bias)``, rounded once: ``x`` ``[..., in]`` (``[..., 2 *
    in]`` for ``silu_mul``: gate then up), bf16 or fp32; the result (and ``residual``) in ``x``'s
    dtype, or fp32. ``lora``: each row's LoRA update added after, ``out[r] + B_g (A_g
    prologue(x[r]))`` with ``g = lora.group[r]`` (-1: none), ``A_g x`` computed as this matmul
    with an fp32 output from the same quantized activations, the sum with ``out[r]`` rounded once;
    a row's values depend on that row alone. ``scalar``/``portable``: as ``attention``'s."""
    if lora is None:
        return _ops().qlinear(
            x, prologue, norm_weight, eps, weight.data, weight.scales, weight.mins, weight.super_scales,
            weight.super_mins, weight.zero, weight.bits, weight.out_features, weight.in_features, bias, residual,
            out_float32, scalar, portable,
        )  # fmt: skip
    return _ops().qlinear_lora(
        x, prologue, norm_weight, eps, weight.data, weight.scales, weight.mins, weight.super_scales,
        weight.super_mins, weight.zero, weight.bits, weight.out_features, weight.in_features, bias, residual,
        out_float32, lora.factors, lora.group, scalar, portable,
    )  # fmt: skip


class LoraB(NamedTuple):
    """A LoRA update's ``B`` (``[out_features, rank]``) by parts, for ``lora_factors``: part
    ``(n0, outs, k0, rank)`` gives outputs ``n0..n0+outs`` from ``t[k0..k0+rank]`` (a joined
    projection's update is block-diagonal); each part's values are 8-bit columns by 16-output
    block, ``[blocks, rank, 16]`` in ``data``, with a float16 scale per block and column,
    ``[blocks, rank]`` in ``scales``."""

    data: torch.Tensor  # int8, the parts one after another
    scales: torch.Tensor  # float16
    parts: tuple[tuple[int, int, int, int], ...]
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 2 * self.scales.numel()


def pack_lora_b(parts: list[tuple[int, int, torch.Tensor]], out_features: int) -> LoraB:
    """``(n0, k0, b)`` per part, ``b`` ``[outs, rank]``: symmetric 8-bit columns per block of 16
    outputs, ``scale = max|b| / 127`` rounded up to a float16."""
    data, scales, table = [], [], []
    for n0, k0, b in parts:
        outs, rank = b.shape
        blocks = -(-outs // LANES)
        full = torch.cat([b.detach().float(), b.new_zeros(blocks * LANES - outs, rank, dtype=torch.float32)])
        full = full.view(blocks, LANES, rank)
        half = _half_up(full.abs().amax(dim=1) / 127.0)  # [blocks, rank]
        safe = torch.where(half.float() > 0, half.float(), torch.ones_like(half, dtype=torch.float32))
        values = torch.round(full / safe[:, None, :]).clamp(-127, 127).to(torch.int8)
        data.append(values.permute(0, 2, 1).reshape(-1))
        scales.append(half.reshape(-1))
        table.append((n0, outs, k0, rank))
    return LoraB(torch.cat(data).contiguous(), torch.cat(scales).contiguous(), tuple(table), out_features)


def unpack_lora_b(b: LoraB, rank: int) -> torch.Tensor:
    """``pack_lora_b``'s inverse, as float32 ``[out_features, rank]`` (zeros outside the parts)."""
    full = torch.zeros(b.out_features, rank)
    data_at = scales_at = 0
    for n0, outs, k0, part_rank in b.parts:
        blocks = -(-outs // LANES)
        values = b.data[data_at : data_at + blocks * part_rank * LANES].view(blocks, part_rank, LANES).float()
        scales = b.scales[scales_at : scales_at + blocks * part_rank].view(blocks, part_rank, 1).float()
        dense = (values * scales).permute(0, 2, 1).reshape(blocks * LANES, part_rank)[:outs]
        full[n0 : n0 + outs, k0 : k0 + part_rank] = dense
        data_at += blocks * part_rank * LANES
        scales_at += blocks * part_rank
    return full


def lora_factors(a: list[PackedWeight], b: list[LoraB]) -> Any:
    """Several LoRA adapters' factors at one projection, for ``matmul``'s ``lora``: ``a[g]``
    ``[rank, in]`` packed 8-bit (``pack_int8``) and ``b[g]`` (``pack_lora_b``); checked and
    gathered once into the kernel's own object, which holds the tensors."""
    assert all(w.bits == 8 and w.zero == 128 and w.mins is None for w in a)
    return _ops().LoraFactors(
        [w.data for w in a], [w.scales for w in a], [w.out_features for w in a], [f.data for f in b],
        [f.scales for f in b], [[number for part in f.parts for number in part] for f in b], a[0].in_features,
        b[0].out_features,
    )  # fmt: skip


def experts_kernel(
    router: PackedWeight, gate_up: Sequence[PackedWeight], down: Sequence[PackedWeight], norm_weight: torch.Tensor,
    eps: float, top_k: int, norm_topk_prob: bool,
) -> Any:  # fmt: skip
    """A mixture-of-experts layer's weights for ``experts``: the router ``[experts, hidden]``,
    each expert's joined gate/up ``[2 * inter, hidden]`` and down ``[hidden, inter]``, and the
    RMSNorm before them; checked and gathered once into the kernel's own object, which holds the
    tensors."""
    weights = [router, *gate_up, *down]
    return _ops().Experts(
        [[w.data, w.scales, w.mins, w.super_scales, w.super_mins] for w in weights],
        [[w.zero, w.bits, w.out_features, w.in_features] for w in weights],
        norm_weight.detach(), eps, top_k, norm_topk_prob,
    )  # fmt: skip


def experts(
    kernel: Any, x: torch.Tensor, *, scalar: bool = False, portable: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., hidden]`` (bf16 or fp32, not yet normalised) plus its mixture-of-experts
    output, in one call, and each token's chosen experts ``[tokens, top_k]`` (int64, rank order).
    The bits are those of ``matmul``, ``exp_shifted`` and ``block_sums`` composed as
    ``exact.cpp`` describes; a token's depend on its row alone. ``scalar``/``portable``: as
    ``attention``'s."""
    out, index = _ops().experts(kernel, x, scalar, portable)
    return out, index


class LoraRows(NamedTuple):
    """Each row's adapter at one projection: ``group[r]`` indexes the adapters of ``factors``
    (``lora_factors``; int64, -1: none)."""

    factors: Any
    group: torch.Tensor


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, scale: float,
    scalar: bool = False, portable: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``query`` ``[rows, heads, queries, dim]`` against ``key``/``value`` ``[rows, kv_heads, keys,
    dim]``, query ``(r, t)`` seeing keys ``0..positions[r, t]``; ``[rows, queries, heads, dim]``.
    ``scalar``: the code a CPU without AVX512-VNNI runs (AVX2 where it has it); ``portable``: the
    plain C++ every CPU can run. All three give the same bits."""
    return _ops().attention(query, key, value, positions, scale, scalar, portable)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scalar: bool = False) -> torch.Tensor:
    return _ops().rms_norm(x, weight, eps, scalar)


def exp_shifted(x: torch.Tensor, scalar: bool = False) -> torch.Tensor:
    """``exp(x - max(x))`` per row of fp32 ``[rows, width]``: unnormalised probabilities."""
    return _ops().exp_shifted(x, scalar)


def block_sums(x: torch.Tensor, block: int, scalar: bool = False) -> torch.Tensor:
    """Sums of each ``block``-wide run of each row of fp32 ``[rows, width]`` (the last may be shorter)."""
    return _ops().block_sums(x, block, scalar)


class ExactLinear(nn.Module):
    """A ``Linear`` served by ``matmul`` on a packed weight; ``prologue`` fuses the RMSNorm before
    it (``norm``) or the SwiGLU product (``silu_mul``) into the activations' quantization."""

    def __init__(
        self,
        weight: PackedWeight,
        bias: torch.Tensor | None,
        prologue: int = PROLOGUE_NONE,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        out_float32: bool = False,
    ) -> None:
        super().__init__()
        self.packed = weight
        self.bias = None if bias is None else nn.Buffer(bias.detach().float().contiguous())
        self.prologue = prologue
        self.norm_weight = None if norm_weight is None else nn.Buffer(norm_weight.detach().contiguous())
        self.eps = eps
        self.out_float32 = out_float32

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, lora: LoraRows | None = None
    ) -> torch.Tensor:
        return matmul(
            x, self.packed, self.bias, prologue=self.prologue, norm_weight=self.norm_weight, eps=self.eps,
            residual=residual, out_float32=self.out_float32, lora=lora,
        )  # fmt: skip


def unpack(weight: PackedWeight) -> torch.Tensor:
    """``pack``'s inverse, as float32 ``[out, in]`` weights."""
    blocks = weight.scales.shape[0]
    groups = weight.scales.shape[1]
    data = weight.data.view(blocks, groups, 8 if weight.bits == 8 else 4, LANES, 4)
    if weight.bits == 4:
        data = torch.cat([data & 0x0F, data >> 4], dim=2)
    values = data.permute(0, 3, 1, 2, 4).reshape(blocks * LANES, groups, GROUP).float()
    group_scale, group_min = weight.group_scales()
    scales = group_scale.permute(0, 2, 1).reshape(blocks * LANES, groups, 1)
    full = scales * (values - weight.zero)
    if group_min is not None:
        full = full + group_min.permute(0, 2, 1).reshape(blocks * LANES, groups, 1)
    return full.reshape(blocks * LANES, groups * GROUP)[: weight.out_features, : weight.in_features]


if __name__ == "__main__":  # `make venv` builds the extension once, so the first worker need not
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if load():
        logger.info("exact kernels built (%s)", code_path())
