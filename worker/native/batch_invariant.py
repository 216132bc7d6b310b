"""Batch-invariant matmul and attention for the native decoder (``--deterministic on``): a row's
result is the same bits whatever other rows share the call, however its prompt was chunked,
and whether its keys came from the prefix cache or were computed in this step.

What the CPU kernels give, and what is done about it (``tests/worker/test_batch_invariant.py``
checks each on torch's own kernels):

- oneDNN picks its bf16 GEMM kernel, and with it the order a row's sums are taken in, from the
  row count, and the choice differs between CPUs: on AMD Zen 4 one row alone differed from the
  same row among two or more; on an Intel Xeon with AMX whole ranges of row counts (2-32, 33-479,
  ...) gave other bits, some shapes flipping back and forth. No rule about row counts is safe to
  assume, so it is checked instead: every matmul runs in tiles of at most ``tile`` rows (rows
  beyond a tile are separate calls, which costs long prefills some speed), and at load time
  ``invariant_matmul`` tries the forms of ``CANDIDATES`` in order on the model's own weights
  (oneDNN's packed layout, which fixes the kernel's blocking and is the fastest; calls padded to
  ``min_rows``; ``F.linear``), keeping the first with which a row gets the same bits in a call
  of any 1..tile rows, at any place in it, at one thread, two and all the worker's cores. On the
  Xeon the first holds for every shape checked.
- torch's CPU flash attention gives a query the same bits in any call when two things hold:
  the keys' count is a multiple of ``KEY_BLOCK`` (its reductions then never reach a scalar tail;
  the caller reads keys past the rows' lengths, masked), and none of its query blocks has fewer
  than ``MIN_QUERY_ROWS`` rows (small blocks took another GEMM kernel on Zen 4), which the query
  rows are padded for.
- The packed int4 / int8 kernels are row-invariant too, but give other bits than the bf16
  GEMM: a model uses one or the other for every row count, never both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KEY_BLOCK = 64  # a multiple of every vector width the kernels use
MIN_QUERY_ROWS = 4


@dataclass(frozen=True)
class MatmulForm:
    """How a matmul is called: on oneDNN's packed weight or through ``F.linear``, in tiles of at
    most ``tile`` rows, each call padded to at least ``min_rows`` rows (repeats of its last row)."""

    packed: bool
    tile: int
    min_rows: int = 1


# Tried in this order: packed is fastest, larger tiles make prefills faster, padding costs single
# streams. (False, 64, 2) is Zen 4's rule (a lone row computed as two); full tiles are the last resort.
CANDIDATES = (
    MatmulForm(True, 64), MatmulForm(True, 64, 2), MatmulForm(False, 64, 2), MatmulForm(True, 32),
    MatmulForm(True, 16), MatmulForm(True, 64, 64), MatmulForm(False, 64, 64),
)  # fmt: skip
ROW_TILES = tuple(sorted({form.tile for form in CANDIDATES}, reverse=True))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[out, in]`` in oneDNN's blocked layout for its inner-product kernel; None where
    oneDNN cannot (no bf16 support on this CPU)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    except RuntimeError:
        return None


@dataclass
class InvariantMatmul:
    """``y = x W^T (+ b)`` called as ``form`` says, on ``weight`` (packed by ``pack`` when
    ``form.packed``); ``invariant_matmul`` finds a form that is batch-invariant."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    form: MatmulForm

    @property
    def packed(self) -> bool:
        return self.form.packed

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        count = rows.shape[0]
        if count < self.form.min_rows:
            rows = torch.cat([rows, rows[-1:].expand(self.form.min_rows - count, -1)])
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        else:
            out = F.linear(rows, self.weight, self.bias)
        return out[:count]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        rows, tile = flat.shape[0], self.form.tile
        if rows <= tile:
            out = self._call(flat)
        else:
            out = torch.cat([self._call(flat[start : start + tile]) for start in range(0, rows, tile)])
        return out.view(*x.shape[:-1], out.shape[-1])

    def dense_weight(self) -> torch.Tensor:
        return self.weight.to_dense() if self.packed else self.weight


def is_row_invariant(
    matmul: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype, tile: int,
    thread_counts: Iterable[int],
) -> bool:  # fmt: skip
    """Whether ``matmul`` gives a row the same bits alone, in a call of any 2..``tile`` rows at any
    place in it, and in a call of several tiles, at each of ``thread_counts``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * tile + 5, in_features, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    reference: torch.Tensor | None = None
    try:
        for count in thread_counts:
            torch.set_num_threads(count)
            every_row = matmul(x)
            if reference is None:
                reference = every_row
            elif not torch.equal(every_row, reference):
                return False
            for start in (0, 1, tile // 2 + 1, tile - 1, tile + 3):
                # From ``start`` on, rows sit at other places of their tile than in ``every_row``.
                for count_rows in range(1, tile + 1) if start == 0 else (1, 2, tile - start % tile, tile):
                    if count_rows > 0 and not torch.equal(matmul(x[start : start + count_rows]),
                                                          reference[start : start + count_rows]):  # fmt: skip
                        return False
    finally:
        torch.set_num_threads(threads)
    return True


def invariant_matmul(
    weight: torch.Tensor, bias: torch.Tensor | None, thread_counts: Iterable[int],
    verified: dict[tuple[int, ...], MatmulForm | None],
) -> InvariantMatmul | None:  # fmt: skip
    """``weight``'s matmul in the first form of ``CANDIDATES`` that ``is_row_invariant`` holds for
    (None where none does). ``verified`` remembers the form per shape, so a model's thirty layers
    are checked once per shape."""
    out_features, in_features = weight.shape
    key = (out_features, in_features, int(bias is not None))
    if key in verified:
        form = verified[key]
        candidates: tuple[MatmulForm, ...] = () if form is None else (form,)
    else:
        candidates = CANDIDATES
    packed = pack(weight) if any(form.packed for form in candidates) else None  # once, and only if used
    for form in candidates:
        if form.packed and packed is None:
            continue
        matmul = InvariantMatmul(packed if form.packed else weight, bias, form)
        if key in verified or is_row_invariant(matmul, in_features, weight.dtype, form.tile, tuple(thread_counts)):
            verified[key] = form
            return matmul
    verified.setdefault(key, None)
    return None


def _query_block(num_rows: int) -> int:
    """The query block torch's CPU flash attention splits ``num_rows`` query rows into."""
    return 256 if num_rows >= 768 else 64 if num_rows >= 192 else 32


def padded_query_rows(num_rows: int) -> int:
    """Query rows to compute so that no query block has fewer than ``MIN_QUERY_ROWS`` rows."""
    rows = max(num_rows, MIN_QUERY_ROWS)
    tail = rows % _query_block(rows)
    return rows + MIN_QUERY_ROWS - tail if 0 < tail < MIN_QUERY_ROWS else rows


def additive_mask(mask: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The boolean ``[rows, 1, queries, keys]`` mask of a step as the attention below takes it:
    a kv head's query heads as query rows (each repeating the queries' mask), padded like the
    query rows, 0 where a query may attend and -inf elsewhere. Built once per forward."""
    queries = mask.shape[2]
    if queries > 1 and group_size > 1:
        mask = mask.repeat(1, 1, group_size, 1)
    rows = mask.shape[2]
    if queries > 1 and padded_query_rows(rows) > rows:
        mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, padded_query_rows(rows) - rows, -1)], dim=2)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention(
    grouped_query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``grouped_query`` ``[rows, kv_heads, queries, dim]`` (a kv head's query heads, and their
    positions, as query rows) against ``key``/``value`` ``[rows, kv_heads, keys, dim]``, ``keys`` a
    multiple of ``KEY_BLOCK``; ``mask`` from ``additive_mask``."""
    num_rows = grouped_query.shape[2]
    padded = padded_query_rows(num_rows)
    if padded > num_rows:  # repeats of the last row, whose results are dropped
        grouped_query = torch.cat([grouped_query, grouped_query[:, :, -1:].expand(-1, -1, padded - num_rows, -1)], 2)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        grouped_query.contiguous(), key, value, 0.0, False, attn_mask=mask, scale=scale
    )
    return out[:, :, :num_rows]
