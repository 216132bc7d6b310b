"""A 4-bit GGUF's own groups: read from raw blocks exactly as gguf-py dequantizes them (any block
bytes, Q4_0 / Q4_1 / Q4_K), matched to converted weights whose rows transformers reordered,
refused where they do not reproduce the weight, kept on disk, and packed by ``Int4Linear``; and
the default model served as its file's own 4-bit weights by default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.test_native_decoder import FAMILIES, _save
from worker.models.loader import load_model
from worker.native import exact as exact_kernels
from worker.native.decoder import JoinedLinear, Linear, NativeCausalLM
from worker.native.gguf_groups import (
    GROUPS_FILE,
    Int4Groups,
    extract_int4_groups,
    hf_weight_name,
    load_groups,
    read_groups,
    save_groups,
)
from worker.native.quantize import Int4Linear, Int8Linear, quantize_int4_groups

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}
HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}  # the fp16 fields of a block


def _random_blocks(type_name: str, num_blocks: int, seed: int) -> np.ndarray:
    """Any bytes, except that the fp16 scales are finite (as a quantizer writes them)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(num_blocks, BLOCK_BYTES[type_name]), dtype=np.uint8)
    for offset in HALF_OFFSETS[type_name]:
        halves = rng.uniform(-0.05, 0.05, size=num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(num_blocks, 2)
    return blocks


@settings(max_examples=30, deadline=None)
@given(type_name=st.sampled_from(sorted(BLOCK_BYTES)), rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_groups_reproduce_gguf_dequantization_bit_for_bit(type_name: str, rows: int, seed: int) -> None:
    width = 2 * BLOCK_WEIGHTS[type_name]
    blocks = _random_blocks(type_name, rows * width // BLOCK_WEIGHTS[type_name], seed)
    groups = read_groups(blocks.reshape(rows, -1), type_name, (rows, width))
    assert groups is not None
    assert int(groups.values.max()) <= 15 and groups.values.dtype == torch.uint8
    reference = dequantize(blocks.reshape(rows, -1), GGMLQuantizationType[type_name]).reshape(rows, width)
    assert torch.equal(groups.dequantize(), torch.from_numpy(reference))


def test_q4_k_groups_keep_the_files_factors_through_joins_reordering_and_the_disk(tmp_path: Path) -> None:
    """A Q4_K weight's scales and mins are products of the file's factors, exactly; the factors
    follow a join, a row permutation and a save and load; packed, they are the kernels' factored
    scales, whose weights are the file's."""
    rows, width = 5, 512
    blocks = _random_blocks("Q4_K", rows * width // 256, seed=3)
    groups = read_groups(blocks.reshape(rows, -1), "Q4_K", (rows, width))
    assert groups is not None and groups.factors is not None
    factors = groups.factors
    assert torch.equal(factors.d.repeat_interleave(8, dim=1) * factors.sc.float(), groups.group_scale)
    assert torch.equal(factors.neg_dmin.repeat_interleave(8, dim=1) * factors.m.float(), groups.group_min)
    order = torch.tensor([4, 0, 3, 1, 2])
    joined = Int4Groups.joined([groups, groups.permute_rows(order)])
    assert joined.factors is not None and torch.equal(joined.factors.sc[5:], factors.sc[order])
    plain = Int4Groups(groups.values, groups.group_scale, groups.group_min)
    assert Int4Groups.joined([groups, plain]).factors is None  # a join keeps factors only where all parts have them
    save_groups({"w": joined}, tmp_path / GROUPS_FILE)
    loaded = load_groups(tmp_path)["w"]
    assert loaded.factors is not None
    fields = ("d", "sc", "neg_dmin", "m")
    assert all(torch.equal(getattr(loaded.factors, f), getattr(joined.factors, f)) for f in fields)
    packed = loaded.pack()
    assert packed.super_scales is not None and packed.scales.dtype == torch.uint8
    assert torch.equal(exact_kernels.unpack(packed), joined.dequantize())


def test_types_that_are_not_4_bit_have_no_groups() -> None:
    assert read_groups(np.zeros((1, 34), dtype=np.uint8), "Q8_0", (1, 32)) is None


def test_gguf_names_map_to_the_projections_only() -> None:
    assert hf_weight_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_weight_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_weight_name("token_embd.weight") is None and hf_weight_name("blk.0.attn_norm.weight") is None


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], rows: int) -> None:
    writer = GGUFWriter(str(path), "llama")
    for name, blocks in tensors.items():
        writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=GGMLQuantizationType.Q4_1)  # rows of block bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_extraction_follows_reordered_rows_and_refuses_a_weight_it_cannot_reproduce(tmp_path: Path) -> None:
    out, width = 8, 64
    blocks = {name: _random_blocks("Q4_1", out * width // 32, seed) for seed, name in
              enumerate(["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight"])}  # fmt: skip
    _write_gguf(tmp_path / "m.gguf", blocks, out)
    dequantized = {name: torch.from_numpy(dequantize(b.reshape(out, -1), GGMLQuantizationType.Q4_1)).reshape(out, width)
                   for name, b in blocks.items()}  # fmt: skip
    order = torch.randperm(out, generator=torch.Generator().manual_seed(0))
    checkpoint = {
        "model.layers.0.self_attn.q_proj.weight": dequantized["blk.0.attn_q.weight"][order],  # rows reordered
        "model.layers.0.self_attn.k_proj.weight": dequantized["blk.0.attn_k.weight"],
        "model.layers.0.mlp.up_proj.weight": dequantized["blk.0.ffn_up.weight"] * 1.001,  # not the file's weight
    }
    groups = extract_int4_groups(tmp_path / "m.gguf", checkpoint)
    assert set(groups) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    for name, group in groups.items():
        assert torch.equal(group.dequantize(), checkpoint[name])
    save_groups(groups, tmp_path / GROUPS_FILE)
    for name, group in load_groups(tmp_path).items():
        assert torch.equal(group.values, groups[name].values) and torch.equal(group.dequantize(), checkpoint[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_multiplies_by_the_given_groups(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    values = torch.randint(0, 16, (96, 64), dtype=torch.uint8)
    groups = Int4Groups(values, torch.rand(96, 2) / 50, torch.randn(96, 2) / 10)
    weight = groups.dequantize()
    linear = Int4Linear(weight, None, dtype, groups)
    x = torch.randn(2, 64).to(dtype)
    exact = F.linear(x.float(), weight)
    # bf16 rounds the scales and the activations; nothing is re-quantized.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((linear(x).float() - exact).norm() / exact.norm()).item() < tolerance


def test_joined_groups_stack_in_row_order() -> None:
    parts = [Int4Groups(torch.full((rows, 32), rows, dtype=torch.uint8), torch.ones(rows, 1), torch.zeros(rows, 1))
             for rows in (2, 3)]  # fmt: skip
    joined = Int4Groups.joined(parts)
    assert joined.values[:, 0].tolist() == [2, 2, 3, 3, 3] and joined.group_scale.shape == (5, 1)


def test_the_default_model_serves_its_files_own_4_bit_weights_by_default(default_model_path: Path) -> None:
    groups = load_groups(default_model_path)
    assert len(groups) == 30 * 7  # every projection of every layer: the file is Q4_1 throughout
    loaded = load_model(str(default_model_path), default_model_path, "cpu", "auto", 512, "native")
    model = loaded.model
    assert isinstance(model, NativeCausalLM)
    assert not any(isinstance(module, Linear) for module in model.modules())  # JoinedLinear included
    assert isinstance(model.head, Int8Linear)
    qkv = model.model.layers[3].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear)
    names = [f"model.layers.3.self_attn.{part}.weight" for part in ("q_proj", "k_proj", "v_proj")]
    expected = Int4Groups.joined([groups[name] for name in names])
    unpacked = torch.ops.aten._weight_int4pack_mm_for_cpu(
        torch.eye(576, dtype=model.dtype), qkv.packed, 32, qkv.scales_and_zeros
    )  # the identity times the packed weight: the weight the kernel reads, transposed
    # What the kernel should compute from the groups: (q - 8) * scale + (min + 8 * scale), both in bf16.
    scale = expected.group_scale.to(model.dtype).float()
    zero = (expected.group_min + 8 * expected.group_scale).to(model.dtype).float()
    grouped = expected.values.float().view(len(expected.values), -1, 32)
    reference = ((grouped - 8) * scale[..., None] + zero[..., None]).view(len(expected.values), -1)
    torch.testing.assert_close(unpacked.T.float(), reference.to(model.dtype).float(), rtol=0, atol=0)
    none = load_model(str(default_model_path), default_model_path, "cpu", "auto", 512, "native", "none")
    assert isinstance(none.model, NativeCausalLM)
    assert isinstance(none.model.model.layers[0].mlp.gate_up_proj, JoinedLinear)  # not packed


def test_auto_packs_the_matmuls_that_have_groups_and_leaves_the_rest(tmp_path: Path) -> None:
    # As Qwen2.5-Coder's Q4_K_M file: 4-bit groups for some projections only (the rest Q5/Q6/Q8).
    folder = _save(FAMILIES["llama"], tmp_path)
    plain = load_model(str(folder), tmp_path, "cpu", "float32", None, "native", "none")
    assert isinstance(plain.model, NativeCausalLM)
    assert isinstance(plain.model.model.layers[0].mlp.gate_up_proj, JoinedLinear)  # no file: auto is none
    assert plain.model.head is None
    layer = plain.model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert qkv is not None
    # Groups for layer 0's q/k/v (joined on load) and down projection; gate/up and layer 1 have none.
    widths = [64, 32, 32]  # q, k, v rows of the joined weight
    parts = torch.split(qkv.weight, widths)
    groups = {f"model.layers.0.self_attn.{name}.weight": quantize_int4_groups(part)
              for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True)}  # fmt: skip
    groups["model.layers.0.mlp.down_proj.weight"] = quantize_int4_groups(down.weight)
    save_groups(groups, folder / GROUPS_FILE)

    packed = load_model(str(folder), tmp_path, "cpu", "float32", None, "native")  # auto
    model = packed.model
    assert isinstance(model, NativeCausalLM) and isinstance(model.head, Int8Linear)
    first, second = model.model.layers
    assert isinstance(first.self_attn.qkv_proj, Int4Linear) and isinstance(first.mlp.down_proj, Int4Linear)
    assert type(first.mlp.gate_up_proj) is JoinedLinear and type(first.self_attn.o_proj) is Linear
    assert not any(isinstance(module, Int4Linear) for module in second.modules())
    # The packed q/k/v multiplies by the groups given, joined in q, k, v row order.
    names = [f"model.layers.0.self_attn.{part}.weight" for part in ("q_proj", "k_proj", "v_proj")]
    expected = Int4Groups.joined([groups[name] for name in names]).dequantize()
    unit_rows = torch.eye(64)[:4]  # 4 rows: the packed path; row i times W^T is W's column i
    torch.testing.assert_close(first.self_attn.qkv_proj(unit_rows[None])[0], expected.T[:4])
    # none ignores the file.
    none = load_model(str(folder), tmp_path, "cpu", "float32", None, "native", "none")
    assert isinstance(none.model, NativeCausalLM) and none.model.head is None
