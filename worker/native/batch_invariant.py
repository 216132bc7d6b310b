"""Batch-invariant matmul and attention for the native decoder (``--deterministic on``): a row's
result is the same bits whatever other rows share the call, however its prompt was chunked,
and whether its keys came from the prefix cache or were computed in this step.

What the CPU kernels give, and what is done about it (``tests/worker/test_batch_invariant.py``
checks each on torch's own kernels):

- oneDNN picks its bf16 GEMM kernel, and with it the order a row's sums are taken in, from the
  row count, and the choice differs between CPUs: on AMD Zen 4 one row alone differed from the
  same row among two or more; on an Intel Xeon with AMX whole ranges of row counts (2-32, 33-479,
  ...) gave other bits, some shapes flipping back and forth. No rule about row counts is safe to
  assume, so it is checked instead: each weight is packed once for oneDNN (the layout fixes the
  kernel's blocking), every matmul runs in tiles of at most ``tile`` rows, and at load time
  ``row_tile`` checks on the model's own weights that a row gets the same bits in a call of
  any 1..tile rows, at any place in it, at one thread and at the worker's count, taking the
  largest tile of ``ROW_TILES`` that holds (64 on both CPUs). Rows beyond a tile are separate
  calls, which costs long prefills some speed (see README's Determinism section).
- torch's CPU flash attention gives a query the same bits in any call when two things hold:
  the keys' count is a multiple of ``KEY_BLOCK`` (its reductions then never reach a scalar tail;
  the caller reads keys past the rows' lengths, masked), and none of its query blocks has fewer
  than ``MIN_QUERY_ROWS`` rows (small blocks took another GEMM kernel on Zen 4), which the query
  rows are padded for.
- The packed int4 / int8 kernels are row-invariant too, but give other bits than the bf16
  GEMM: a model uses one or the other for every row count, never both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

KEY_BLOCK = 64  # a multiple of every vector width the kernels use
MIN_QUERY_ROWS = 4
ROW_TILES = (64, 32, 16)  # tried in this order: larger tiles make prefills faster


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
    """``y = x W^T (+ b)`` in tiles of at most ``tile`` rows, on oneDNN's packed weight (or plain
    ``F.linear`` where it could not be packed); ``row_tile`` finds a tile that is invariant."""

    weight: torch.Tensor  # packed (``pack``) or plain
    bias: torch.Tensor | None
    tile: int

    @property
    def packed(self) -> bool:
        return self.weight.is_mkldnn

    def _call(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return F.linear(rows, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        rows = flat.shape[0]
        if rows <= self.tile:
            out = self._call(flat)
        else:
            out = torch.cat([self._call(flat[start : start + self.tile]) for start in range(0, rows, self.tile)])
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
    weight: torch.Tensor, bias: torch.Tensor | None, thread_counts: Iterable[int], verified: dict[tuple[int, ...], int]
) -> InvariantMatmul | None:
    """``weight``'s matmul with the largest tile of ``ROW_TILES`` that ``is_row_invariant`` holds for
    (None where none does). ``verified`` remembers the tile per shape, so a model's thirty layers
    are checked once per shape."""
    packed = pack(weight)
    out_features, in_features = weight.shape
    key = (out_features, in_features, int(bias is not None), int(packed is not None))
    candidates = ROW_TILES if key not in verified else (verified[key],) if verified[key] else ()
    counts = tuple(thread_counts)
    for tile in candidates:
        matmul = InvariantMatmul(weight if packed is None else packed, bias, tile)
        if key in verified or is_row_invariant(matmul, in_features, weight.dtype, tile, counts):
            verified[key] = tile
            return matmul
    verified[key] = 0
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
