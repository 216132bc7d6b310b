"""The exact kernels (``worker/native/exact.py``): a row's bits are a function of that row, by
construction. Checked here as properties over random shapes, rows, slices and thread counts:

- the vector (AVX512-VNNI, AVX2) code and the portable code give the same bits, and so do a
  GGUF's Q4_K scales kept factored and their products;
- the quantized matmul equals a plain-torch statement of its definition (int8 activations per
  block of 32, integer group sums, the float epilogue in group order), bit for bit;
- a row (a query) gets the same bits alone, in any slice of a batch, and at 1 or 2 threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.native import exact
from worker.native.quantize import quantize_int4_groups

pytestmark = pytest.mark.skipif(not exact.available(), reason="the exact kernels need a C++ compiler")

# SmolLM2-135M's matmuls (q/k/v joined, o, gate/up joined, down, head) and Qwen-like ones.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (1152, 896), (896, 4864)]


@contextmanager
def threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _weight(out_features: int, in_features: int, bits: int, seed: int, half: bool = False) -> exact.PackedWeight:
    """Random weights in 4- or 8-bit groups; ``half``: scales that float16 holds exactly (as a
    GGUF's), which the packing then stores as float16."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    padded = -(-in_features // exact.GROUP) * exact.GROUP
    full = torch.cat([weight, weight.new_zeros(out_features, padded - in_features)], dim=1)
    if bits == 8:
        grouped = full.view(out_features, -1, exact.GROUP)
        scales = grouped.abs().amax(dim=-1) / 127 + 1e-4
        scales = scales.half().float() if half else scales
        values = (torch.round(grouped / scales[..., None]).clamp(-127, 127) + 128).to(torch.uint8)
        packed = exact.pack(values.view(out_features, padded)[:, :in_features].contiguous(), scales, None, 128, 8)
    else:
        groups = quantize_int4_groups(full)
        scales, mins = groups.group_scale, groups.group_min
        scales, mins = (scales.half().float(), mins.half().float()) if half else (scales, mins)
        packed = exact.pack(groups.values[:, :in_features].contiguous(), scales, mins, 0, 4)
    assert (packed.scales.dtype == torch.float16) == half
    return packed


def reference_matmul(x: torch.Tensor, weight: exact.PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The definition in plain torch ops, for fp32 inputs without a prologue (one rounding per op)."""
    rows, width = x.shape
    groups = -(-width // exact.GROUP)
    act = torch.cat([x.float(), x.new_zeros(rows, groups * exact.GROUP - width, dtype=torch.float32)], dim=1)
    act = act.view(rows, groups, exact.GROUP)
    amax = act.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    d = amax / 127.0
    q = torch.round(act * inv[..., None]).clamp(-127, 127).to(torch.int64)
    sums = q.sum(dim=-1)
    blocks = weight.scales.shape[0]
    data = weight.data.view(blocks, groups, 8 if weight.bits == 8 else 4, exact.LANES, 4)
    if weight.bits == 4:
        data = torch.cat([data & 0x0F, data >> 4], dim=2)
    values = data.permute(0, 3, 1, 2, 4).reshape(blocks * exact.LANES, groups, exact.GROUP).to(torch.int64)
    dots = torch.einsum("rgk,ngk->rng", q, values)  # exact integers
    scales = weight.scales.float().permute(0, 2, 1).reshape(-1, groups)
    mins = None if weight.mins is None else weight.mins.float().permute(0, 2, 1).reshape(-1, groups)
    acc = torch.zeros(rows, blocks * exact.LANES)
    for g in range(groups):
        t = scales[None, :, g] * (dots[:, :, g] - weight.zero * sums[:, None, g]).float()
        if mins is not None:
            t = t + mins[None, :, g] * sums[:, None, g].float()
        acc = acc + d[:, None, g] * t
    acc = acc[:, : weight.out_features]
    return acc if bias is None else acc + bias.float()


@settings(max_examples=40, deadline=None)
@given(
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 130),
    rows=st.integers(1, 9),
    bits=st.sampled_from([4, 8]),
    half=st.booleans(),
    with_bias=st.booleans(),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_matmul_is_its_definition_in_vector_and_portable_code(
    out_features: int, in_features: int, rows: int, bits: int, half: bool, with_bias: bool, with_residual: bool,
    seed: int,
) -> None:  # fmt: skip
    weight = _weight(out_features, in_features, bits, seed, half)
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, in_features, generator=generator) * 3
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    residual = torch.randn(rows, out_features, generator=generator) if with_residual else None
    expected = reference_matmul(x, weight, bias)
    expected = expected if residual is None else residual + expected
    assert torch.equal(exact.matmul(x, weight, bias, residual=residual, scalar=True), expected)
    assert torch.equal(exact.matmul(x, weight, bias, residual=residual, portable=True), expected)
    assert torch.equal(exact.matmul(x, weight, bias, residual=residual), expected)


@settings(max_examples=25, deadline=None)
@given(
    out_features=st.integers(1, 40),
    supers=st.integers(1, 3),
    rows=st.integers(1, 9),
    prologue=st.sampled_from([exact.PROLOGUE_NONE, exact.PROLOGUE_RMS_NORM]),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_factored_4_bit_scales_give_the_bits_of_their_products(
    out_features: int, supers: int, rows: int, prologue: int, bf16: bool, seed: int
) -> None:
    """A Q4_K weight kept as its file factors it (per 256 inputs a float16 number, per group of 32
    an integer below 64, for the scale and for the min) gives the bits of the same weight with
    every group's scale and min stored as their float32 products, on every code path, in a fifth
    fewer bytes."""
    generator = torch.Generator().manual_seed(seed)
    in_features, groups = supers * 256, supers * 8
    values = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    d = (torch.rand(out_features, supers, generator=generator) * 0.01).half().float()
    neg_dmin = -(torch.rand(out_features, supers, generator=generator) * 0.01).half().float()
    sc = torch.randint(0, 64, (out_features, groups), generator=generator, dtype=torch.uint8)
    m = torch.randint(0, 64, (out_features, groups), generator=generator, dtype=torch.uint8)
    factored = exact.pack_int4_factored(values, d, sc, neg_dmin, m)
    products = exact.pack_int4(
        values, d.repeat_interleave(8, dim=1) * sc.float(), neg_dmin.repeat_interleave(8, dim=1) * m.float()
    )
    assert torch.equal(exact.unpack(factored), exact.unpack(products))
    assert factored.nbytes <= 0.8 * products.nbytes  # 4.75 bits a weight against 6
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = (torch.randn(rows, in_features, generator=generator) * 2).to(dtype)
    norm = (torch.rand(in_features, generator=generator) + 0.5).to(dtype)
    options = {"prologue": prologue, "norm_weight": norm if prologue == exact.PROLOGUE_RMS_NORM else None, "eps": 1e-5}
    expected = exact.matmul(x, products, **options)  # type: ignore[arg-type]
    for path in ({}, {"scalar": True}, {"portable": True}):
        assert torch.equal(exact.matmul(x, factored, **options, **path), expected)  # type: ignore[arg-type]
        assert torch.equal(exact.matmul(x, products, **options, **path), expected)  # type: ignore[arg-type]


def test_factored_scales_need_whole_super_blocks() -> None:
    values = torch.zeros(16, 288, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 256"):
        exact.pack_int4_factored(values, torch.ones(16, 1), torch.ones(16, 9, dtype=torch.uint8),
                                 torch.ones(16, 1), torch.ones(16, 9, dtype=torch.uint8))  # fmt: skip


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_matmul_bits_do_not_depend_on_the_rows_beside_it(out_features: int, in_features: int, bits: int) -> None:
    """Any row alone, in any slice of up to 300 rows, at one thread and at two, with a bias; and
    the product is the weight's (to int8 activations' precision)."""
    weight = _weight(out_features, in_features, bits, seed=0, half=bits == 4)
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    every_row = exact.matmul(x, weight, bias)
    plain = F.linear(x.float(), exact.unpack(weight), bias.float())
    assert (every_row.float() - plain).norm() / plain.norm() < 0.02
    for count in (1, 2):
        with threads(count):
            alone = torch.cat([exact.matmul(x[i : i + 1], weight, bias) for i in range(0, len(x), 7)])
            assert torch.equal(alone, every_row[::7])
            for start, length in [(0, 2), (5, 3), (9, 17), (31, 39), (60, 70), (3, 130), (100, 200)]:
                assert torch.equal(
                    exact.matmul(x[start : start + length], weight, bias), every_row[start : start + length]
                )
            assert torch.equal(exact.matmul(x.view(3, 100, in_features), weight, bias).view(300, -1), every_row)


@settings(max_examples=50, deadline=None)
@given(
    outs=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    ranks=st.lists(st.integers(1, 40), min_size=3, max_size=3),
    gap=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_a_lora_b_packs_by_parts_within_half_a_step_of_each_column(
    outs: list[int], ranks: list[int], gap: int, seed: int
) -> None:
    """Each part's columns come back within half a quantization step of their block's scale, and
    nothing outside the parts (a joined projection's zeros are not kept). A scale is the block
    column's ``max |b| / 127`` rounded up to a float16: never below it (no value is clipped), and
    above it by at most float16's spacing there (2^-24 where the scale is subnormal)."""
    generator = torch.Generator().manual_seed(seed)
    parts, n0, k0 = [], gap, 0
    for out, rank in zip(outs, ranks, strict=False):
        parts.append((n0, k0, torch.randn(out, rank, generator=generator) * 0.05))
        n0, k0 = n0 + out + gap, k0 + rank
    packed = exact.pack_lora_b(parts, n0)
    assert packed.data.numel() == sum(-(-b.shape[0] // exact.LANES) * exact.LANES * b.shape[1] for _, _, b in parts)
    full = exact.unpack_lora_b(packed, k0)
    expected = torch.zeros(n0, k0)
    scales_at = 0
    for start, first, b in parts:
        expected[start : start + b.shape[0], first : first + b.shape[1]] = b
        blocks = -(-b.shape[0] // exact.LANES)
        padded = torch.cat([b.abs(), b.new_zeros(blocks * exact.LANES - b.shape[0], b.shape[1])])
        least = padded.view(blocks, exact.LANES, -1).amax(dim=1) / 127  # [blocks, rank]
        scale = packed.scales[scales_at : scales_at + least.numel()].view(blocks, -1).float()
        scales_at += least.numel()
        assert bool((scale >= least).all())
        assert bool((scale <= least * (1 + 2**-10) + 2**-24).all())
        step = scale.repeat_interleave(exact.LANES, dim=0)[: b.shape[0]]
        error = (full[start : start + b.shape[0], first : first + b.shape[1]] - b).abs()
        assert bool((error <= step / 2 * (1 + 1e-6)).all())
    assert bool((full[expected == 0] == 0).all())


@settings(max_examples=25, deadline=None)
@given(
    prologue=st.sampled_from([exact.PROLOGUE_NONE, exact.PROLOGUE_RMS_NORM, exact.PROLOGUE_SILU_MUL]),
    groups=st.lists(st.integers(-1, 2), min_size=1, max_size=9),
    bf16=st.booleans(),
    base_bits=st.sampled_from([4, 8]),
    residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lora_updates_give_each_row_its_own_adapters_bits_alone(
    prologue: int, groups: list[int], bf16: bool, base_bits: int, residual: bool, seed: int
) -> None:
    """Each row through its own adapter's factors inside the base matmul's call: the same bits as
    that row alone, at one thread or two, on vector or portable code; rows of no adapter keep the
    base output's bits; an adapted row is the base output plus ``B (A x)``, ``A x`` as ``matmul``
    computes it (B by parts: a joined projection's blocks, one at an unaligned offset)."""
    generator = torch.Generator().manual_seed(seed)
    in_features, out_features = 70, 1100

    def part(n0: int, k0: int, outs: int, rank: int) -> tuple[int, int, torch.Tensor]:
        return n0, k0, torch.randn(outs, rank, generator=generator) * 0.1

    layouts = [[part(0, 0, 1100, 16)], [part(0, 0, 500, 16), part(500, 16, 600, 32)], [part(37, 0, 70, 8)]]
    ranks = [sum(b.shape[1] for _, _, b in layout) for layout in layouts]
    a = [exact.pack_int8(torch.randn(r, in_features, generator=generator) * 0.1) for r in ranks]
    b = [exact.pack_lora_b(layout, out_features) for layout in layouts]
    base = _weight(out_features, in_features, base_bits, seed, half=base_bits == 4)
    span = 2 if prologue == exact.PROLOGUE_SILU_MUL else 1
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = (torch.randn(len(groups), in_features * span, generator=generator) * 2).to(dtype)
    norm = (torch.rand(in_features, generator=generator) + 0.5).to(dtype)
    options = {
        "prologue": prologue,
        "norm_weight": norm if prologue == exact.PROLOGUE_RMS_NORM else None,
        "eps": 1e-5,
        "residual": torch.randn(len(groups), out_features, generator=generator).to(dtype) if residual else None,
    }
    factors = exact.lora_factors(a, b)
    group = torch.tensor(groups)
    y = exact.matmul(x, base, **options)  # type: ignore[arg-type]
    out = exact.matmul(x, base, lora=exact.LoraRows(factors, group), **options)  # type: ignore[arg-type]
    for count in (1, 2):
        with threads(count):
            again = exact.matmul(x, base, lora=exact.LoraRows(factors, group), **options)  # type: ignore[arg-type]
            assert torch.equal(again, out)
    for path in ({"scalar": True}, {"portable": True}):
        other = exact.matmul(x, base, lora=exact.LoraRows(factors, group), **path, **options)  # type: ignore[arg-type]
        assert torch.equal(other, out)
    plain = {key: value for key, value in options.items() if key != "residual"}
    for row, g in enumerate(groups):
        if g < 0:
            assert torch.equal(out[row], y[row])
            continue
        one = {**options, "residual": None if options["residual"] is None else options["residual"][row : row + 1]}  # type: ignore[index]
        alone = exact.matmul(x[row : row + 1], base, lora=exact.LoraRows(factors, group[row : row + 1]), **one)  # type: ignore[arg-type]
        assert torch.equal(alone[0], out[row]), (row, g)
        low = exact.matmul(x[row : row + 1], a[g], out_float32=True, **plain)  # type: ignore[arg-type]
        expected = y[row].float() + (low @ exact.unpack_lora_b(b[g], ranks[g]).T)[0]
        torch.testing.assert_close(out[row].float(), expected, rtol=1e-2, atol=1e-2)


@settings(max_examples=25, deadline=None)
@given(
    prologue=st.sampled_from([exact.PROLOGUE_RMS_NORM, exact.PROLOGUE_SILU_MUL]),
    in_features=st.integers(1, 100),
    rows=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_fused_prologues_are_row_invariant_and_agree_across_code_paths(
    prologue: int, in_features: int, rows: int, seed: int
) -> None:
    weight = _weight(24, in_features, 4, seed)
    generator = torch.Generator().manual_seed(seed)
    width = 2 * in_features if prologue == exact.PROLOGUE_SILU_MUL else in_features
    x = (torch.randn(rows, width, generator=generator) * 2).to(torch.bfloat16)
    norm = torch.rand(in_features, generator=generator).to(torch.bfloat16)
    kwargs = {"prologue": prologue, "norm_weight": norm, "eps": 1e-5}
    every_row = exact.matmul(x, weight, **kwargs)
    assert torch.equal(exact.matmul(x, weight, scalar=True, **kwargs), every_row)
    for i in range(rows):
        assert torch.equal(exact.matmul(x[i : i + 1], weight, **kwargs), every_row[i : i + 1])
    if prologue == exact.PROLOGUE_RMS_NORM:
        act = F.rms_norm(x.float(), (in_features,), norm.float(), 1e-5)
    else:
        gate, up = x.float().chunk(2, dim=-1)
        act = F.silu(gate) * up
    plain = act @ exact.unpack(weight).T
    assert (every_row.float() - plain).abs().max() <= 0.05 * plain.abs().max() + 1e-3


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 7]),
    dim=st.sampled_from([8, 16, 64, 24]),
    queries=st.integers(1, 20),
    extra_keys=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_attention_gives_a_query_the_same_bits_alone_or_among_others(
    rows: int, kv_heads: int, group: int, dim: int, queries: int, extra_keys: int, seed: int
) -> None:
    """Decode (one query) and prefill (many) agree; keys past a query's position never count, so
    padding and stale slot contents change nothing; the AVX512-VNNI, AVX2 and portable code agree."""
    generator = torch.Generator().manual_seed(seed)
    heads, keys = kv_heads * group, queries + extra_keys
    query = torch.randn(rows, heads, queries, dim, generator=generator).to(torch.bfloat16)
    key = torch.randn(rows, kv_heads, keys, dim, generator=generator).to(torch.bfloat16)
    value = torch.randn(rows, kv_heads, keys, dim, generator=generator).to(torch.bfloat16)
    starts = torch.randint(0, extra_keys + 1, (rows, 1), generator=generator)
    positions = starts + torch.arange(queries)[None, :]
    scale = dim**-0.5
    out = exact.attention(query, key, value, positions, scale)
    assert torch.equal(exact.attention(query, key, value, positions, scale, scalar=True), out)
    assert torch.equal(exact.attention(query, key, value, positions, scale, portable=True), out)
    for t in range(queries):
        one = exact.attention(query[:, :, t : t + 1], key, value, positions[:, t : t + 1], scale)
        assert torch.equal(one[:, 0], out[:, t])
    stale = key.clone()
    for r in range(rows):
        stale[r, :, int(positions[r, -1]) + 1 :] = float("nan")
    assert torch.equal(exact.attention(query, stale, value, positions, scale), out)
    with threads(1):
        assert torch.equal(exact.attention(query, key, value, positions, scale), out)
    # And it is attention: a float64 softmax over the visible keys agrees to bf16's precision.
    expanded_key = key.double().repeat_interleave(group, dim=1)
    expanded_value = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("rhtd,rhkd->rhtk", query.double(), expanded_key) * scale
    visible = torch.arange(keys)[None, None, :] <= positions[:, :, None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    plain = torch.einsum("rhtk,rhkd->rthd", scores.softmax(dim=-1), expanded_value)
    assert (out.double() - plain).abs().max() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_long_prompts_attention_agrees_across_paths_and_reads_the_cache_as_each_call_finds_it(
    dtype: torch.dtype,
) -> None:
    """Keys over several of the vector code's key blocks, and many query chunks per kv head (a
    thread converts a kv head's keys once for all its chunks): every path agrees; a cache written
    in place between two calls is read as the second call finds it."""
    generator = torch.Generator().manual_seed(7)
    rows, kv_heads, group, dim, queries, keys = 2, 2, 7, 80, 45, 301
    query = torch.randn(rows, kv_heads * group, queries, dim, generator=generator).to(dtype)
    key = torch.randn(rows, kv_heads, keys, dim, generator=generator).to(dtype)
    value = torch.randn(rows, kv_heads, keys, dim, generator=generator).to(dtype)
    positions = torch.tensor([[keys - queries], [100]]) + torch.arange(queries)[None, :]
    scale = dim**-0.5
    out = exact.attention(query, key, value, positions, scale)
    assert torch.equal(exact.attention(query, key, value, positions, scale, scalar=True), out)
    assert torch.equal(exact.attention(query, key, value, positions, scale, portable=True), out)
    key[:, :, 50:60] = torch.randn(rows, kv_heads, 10, dim, generator=generator).to(dtype)
    value[:, :, 120] = value[:, :, 121]
    for paths in ({}, {"scalar": True}):
        again = exact.attention(query, key, value, positions, scale, **paths)
        assert torch.equal(again, exact.attention(query, key.clone(), value.clone(), positions, scale, portable=True))
        assert not torch.equal(again, out)


@pytest.mark.parametrize(
    ("group", "dim"), [(1, 64), (3, 64), (4, 64), (7, 64), (8, 64), (2, 128), (1, 128), (3, 128), (5, 128), (2, 48)]
)
def test_a_decode_steps_attention_over_a_long_context_agrees_across_paths(group: int, dim: int) -> None:
    """One query per row and kv head group over thousands of keys (the decode step's shape, keys in
    the lanes and several queries' sums in one pass): every path gives the bits of the portable code."""
    generator = torch.Generator().manual_seed(group * 1000 + dim)
    rows, kv_heads, keys = 2, 2, 1500
    query = torch.randn(rows, kv_heads * group, 1, dim, generator=generator).to(torch.bfloat16)
    key = torch.randn(rows, kv_heads, keys, dim, generator=generator).to(torch.bfloat16) * 2
    value = torch.randn(rows, kv_heads, keys, dim, generator=generator).to(torch.bfloat16)
    positions = torch.tensor([[keys - 1], [700]])
    portable = exact.attention(query, key, value, positions, dim**-0.5, portable=True)
    assert torch.equal(exact.attention(query, key, value, positions, dim**-0.5), portable)
    assert torch.equal(exact.attention(query, key, value, positions, dim**-0.5, scalar=True), portable)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 3000),
    block=st.sampled_from([1, 16, 256, 1000]),
    seed=st.integers(0, 99),
)
def test_the_samplers_sums_and_exp_are_row_invariant_and_path_invariant(
    rows: int, width: int, block: int, seed: int
) -> None:
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 8
    probs = exact.exp_shifted(logits)
    assert torch.equal(exact.exp_shifted(logits, scalar=True), probs)
    plain = torch.softmax(logits.double(), dim=-1) / torch.softmax(logits.double(), dim=-1).amax(dim=-1, keepdim=True)
    assert (probs.double() - plain).abs().max() < 1e-6
    sums = exact.block_sums(probs, block)
    assert torch.equal(exact.block_sums(probs, block, scalar=True), sums)
    for r in range(rows):
        assert torch.equal(exact.block_sums(probs[r : r + 1], block), sums[r : r + 1])
        assert torch.equal(exact.exp_shifted(logits[r : r + 1]), probs[r : r + 1])
    with threads(1):
        assert torch.equal(exact.block_sums(probs, block), sums)
    blocks = [probs[:, i : i + block].double().sum(dim=-1) for i in range(0, width, block)]
    assert (sums.double() - torch.stack(blocks, dim=1)).abs().max() < 1e-4 * max(1.0, block / 16)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 8), width=st.integers(1, 200), seed=st.integers(0, 99))
def test_rms_norm_matches_torch_and_agrees_across_paths(rows: int, width: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator).to(torch.bfloat16)
    weight = torch.rand(width, generator=generator).to(torch.bfloat16)
    out = exact.rms_norm(x, weight, 1e-6)
    assert torch.equal(exact.rms_norm(x, weight, 1e-6, scalar=True), out)
    assert torch.equal(exact.rms_norm(x[-1:], weight, 1e-6), out[-1:])
    plain = F.rms_norm(x.float(), (width,), weight.float(), 1e-6)
    assert (out.float() - plain).abs().max() <= 0.01 * plain.abs().max() + 1e-6


def test_packing_round_trips_the_weights() -> None:
    """What the kernels read is the weight: 4-bit groups exactly, 8-bit to half a step."""
    weight = torch.randn(50, 100) * 0.1
    groups = quantize_int4_groups(torch.cat([weight, weight.new_zeros(50, 28)], dim=1))
    packed = exact.pack(groups.values[:, :100].contiguous(), groups.group_scale, groups.group_min, 0, 4)
    assert torch.equal(exact.unpack(packed), groups.dequantize()[:, :100])
    eight = exact.pack_int8(weight)
    step = eight.scales.float().max()  # max|w| / 127 per group, rounded up to a float16 (as Q8_0's)
    assert (exact.unpack(eight) - weight).abs().max() <= step / 2 + 1e-7
