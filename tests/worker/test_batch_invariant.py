"""The kernel facts ``worker/native/batch_invariant.py`` rests on, checked on this torch build
(bf16 on the CPU): if an upgrade changes them, these fail before any text does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.native import batch_invariant
from worker.native.batch_invariant import KEY_BLOCK
from worker.native.decoder import NativeCausalLM
from worker.native.spec import DecoderSpec

# SmolLM2-135M's matmuls (q/k/v joined, gate/up joined, down, head) and Qwen3-0.6B-like ones.
SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576), (2048, 1024), (1024, 2048)]


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_a_rows_matmul_bits_do_not_depend_on_the_rows_beside_it(out_features: int, in_features: int) -> None:
    """The form the check finds on this CPU holds well past what the check tries: any row alone,
    in any slice of up to 300 rows, at one thread and at two, with a bias."""
    torch.manual_seed(0)
    weight = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    matmul = batch_invariant.invariant_matmul(weight, bias, (1, 2), {})
    assert matmul is not None and matmul.form in batch_invariant.CANDIDATES
    x = torch.randn(300, in_features).to(torch.bfloat16)
    every_row = matmul(x)
    assert (every_row.float() - F.linear(x, weight, bias).float()).abs().max() < 0.05  # the same product
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            alone = torch.cat([matmul(x[i : i + 1]) for i in range(0, len(x), 7)])
            assert torch.equal(alone, every_row[::7])
            for start, rows in [(0, 2), (5, 3), (9, 17), (31, 39), (60, 70), (3, 130), (100, 200)]:
                assert torch.equal(matmul(x[start : start + rows]), every_row[start : start + rows]), (start, rows)
            assert torch.equal(matmul(x.view(3, 100, in_features)).view(300, -1), every_row)
    finally:
        torch.set_num_threads(threads)


def test_the_check_refuses_matmuls_whose_bits_follow_the_row_count_or_the_place() -> None:
    """Stand-in matmuls with the two faults the check exists for: another order of the sums below a
    row count (here two half sums for up to 4 rows, as a kernel that splits the inputs would), and
    a row's bits depending on its place in the call."""
    torch.manual_seed(0)
    weight = (torch.randn(256, 512) * 0.05).to(torch.bfloat16)

    def halves(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x[:, :256], weight[:, :256]) + F.linear(x[:, 256:], weight[:, 256:])

    def by_row_count(x: torch.Tensor) -> torch.Tensor:
        return halves(x) if len(x) <= 4 else torch.cat([F.linear(row[None], weight) for row in x])

    def by_place(x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([F.linear(row[None], weight) for row in x])
        out[5::16] = halves(x[5::16])
        return out

    def row_by_row(x: torch.Tensor) -> torch.Tensor:  # one kernel call per row: invariant by construction
        return torch.cat([F.linear(row[None], weight) for row in x])

    assert not batch_invariant.is_row_invariant(by_row_count, 512, torch.bfloat16, 32, (1,))
    assert not batch_invariant.is_row_invariant(by_place, 512, torch.bfloat16, 32, (1,))
    assert batch_invariant.is_row_invariant(row_by_row, 512, torch.bfloat16, 32, (1, 2))


def _tiny_native_model() -> NativeCausalLM:
    spec = DecoderSpec(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=True, qk_norm=False, qkv_bias=True, o_proj_bias=False,
        mlp_bias=False, weight_files=(),
    )  # fmt: skip
    model = NativeCausalLM(spec).to(torch.bfloat16)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    model.join_projections()
    return model


def test_a_model_hands_its_weights_to_the_invariant_matmuls_and_takes_them_back() -> None:
    model = _tiny_native_model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    hidden = torch.randn(3, 5, 64).to(torch.bfloat16)
    plain = model.logits(hidden)
    assert model.set_batch_invariant(True, thread_counts=(1,))
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0  # held once, packed
    assert (model.logits(hidden).float() - plain.float()).abs().max() < 0.05
    assert model.set_batch_invariant(False)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
    assert torch.equal(model.logits(hidden), plain)


def test_the_check_falls_through_to_the_next_form_and_padded_calls_keep_their_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the packed forms fail (stood in for by a check that refuses them), the next form is
    taken: ``F.linear`` with a lone row computed as two (the rule that held on Zen 4)."""
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) * 0.05).to(torch.bfloat16)
    refuse_packed = lambda matmul, *args: not matmul.form.packed  # noqa: E731
    monkeypatch.setattr(batch_invariant, "is_row_invariant", refuse_packed)
    verified: dict[tuple[int, ...], batch_invariant.MatmulForm | None] = {}
    matmul = batch_invariant.invariant_matmul(weight, None, (1,), verified)
    assert matmul is not None and matmul.form == batch_invariant.MatmulForm(False, 64, 2) and not matmul.packed
    assert verified == {(96, 64, 0): matmul.form}
    x = torch.randn(150, 64).to(torch.bfloat16)
    assert matmul(x[:1]).shape == (1, 96) and matmul(x).shape == (150, 96)
    assert torch.equal(matmul(x[:1]), F.linear(x[:1].expand(2, -1).contiguous(), weight)[:1])
    assert torch.equal(matmul(x)[64:128], F.linear(x[64:128], weight))  # the second tile, alone


def test_where_no_form_holds_the_model_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU whose kernels fail the check: no promise, and nothing half-changed."""
    model = _tiny_native_model()
    monkeypatch.setattr(batch_invariant, "is_row_invariant", lambda *args: False)
    assert not model.set_batch_invariant(True, thread_counts=(1,))
    assert not model.batch_invariant and model.invariant_head is None
    assert all(getattr(m, "invariant", None) is None and m.weight.numel() > 0 for m in model.modules()
               if hasattr(m, "invariant"))  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 64), (16, 8, 128), (16, 4, 128)]
)
def test_attention_bits_are_the_same_decoding_alone_padded_and_in_any_prefill_chunk(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """SmolLM2's, Qwen2.5-0.5B's, a multi-head and two Qwen3 shapes: a query's attention alone,
    beside longer rows, and at any place of any prefill chunk."""
    torch.manual_seed(0)
    group, scale, length = heads // kv_heads, head_dim**-0.5, 1400
    query = torch.randn(1, heads, length, head_dim).to(torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, length + KEY_BLOCK, head_dim).to(torch.bfloat16) for _ in range(2))

    def attend(queries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """As the runner calls it: keys read in whole blocks past the rows' lengths, masked."""
        keys = -(-mask.shape[-1] // KEY_BLOCK) * KEY_BLOCK
        padded = torch.zeros(*mask.shape[:-1], keys, dtype=torch.bool)
        padded[..., : mask.shape[-1]] = mask
        additive = batch_invariant.additive_mask(padded, group, torch.bfloat16)
        return batch_invariant.attention(queries, key[:, :, :keys], value[:, :, :keys], additive, scale)

    def decode(position: int, keys: int) -> torch.Tensor:
        """One query row against ``keys`` keys, those past ``position`` masked (a shorter row in a batch)."""
        grouped = query[:, :, position : position + 1].reshape(1, kv_heads, group, head_dim)
        return attend(grouped, (torch.arange(keys) <= position)[None, None, None, :]).reshape(heads, head_dim)

    def prefill(start: int, end: int, position: int) -> torch.Tensor:
        """Queries ``[start, end)`` of a prompt chunk, causally masked; the row of ``position``."""
        grouped = query[:, :, start:end].reshape(1, kv_heads, group * (end - start), head_dim)
        causal = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        return attend(grouped, causal[None, None]).reshape(heads, end - start, head_dim)[:, position - start]

    for position in [0, 1, 31, 100, 511, 512, 600, 1100]:
        alone = decode(position, position + 1)
        for keys in (position + 2, position + 17, length):
            if keys <= length:
                assert torch.equal(decode(position, keys), alone), (position, keys)
        for start in (0, max(0, position - 40), max(0, position - 3), position):
            for end in (position + 1, position + 2, position + 9, position + 100, position + 300):
                if end <= length:
                    assert torch.equal(prefill(start, end, position), alone), (position, start, end)


def test_the_padding_is_what_makes_flash_attention_invariant() -> None:
    """Without whole key blocks and padded query rows, torch's flash attention gives a decode
    step other bits than a prefill chunk (the facts the padding exists for)."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, length = 16, 8, 128, 700
    group = heads // kv_heads
    query = torch.randn(1, heads, length, head_dim).to(torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, length, head_dim).to(torch.bfloat16) for _ in range(2))
    differ = 0
    for position in range(300, 340):
        grouped = query[:, :, position : position + 1].reshape(1, kv_heads, group, head_dim)
        alone = F.scaled_dot_product_attention(grouped, key[:, :, : position + 1], value[:, :, : position + 1])
        chunk = query[:, :, 280 : position + 1].repeat_interleave(1, dim=1)
        causal = torch.arange(position + 1)[None, :] <= torch.arange(280, position + 1)[:, None]
        in_chunk = F.scaled_dot_product_attention(
            chunk, key[:, :, : position + 1].repeat_interleave(group, 1),
            value[:, :, : position + 1].repeat_interleave(group, 1), attn_mask=causal,
        )[:, :, -1]  # fmt: skip
        differ += not torch.equal(alone.reshape(heads, head_dim), in_chunk.reshape(heads, head_dim))
    if differ == 0:
        pytest.skip("this CPU's flash attention gives these the same bits even unpadded (an Intel AMX Xeon "
                    "does; an AMD Zen 4 did not)")  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_packed_low_bit_matmuls_serving_every_row_are_row_invariant(kind: str) -> None:
    """``--deterministic on --quantization int4|int8``: the packed kernels serve every row count
    (they loop over rows), so a row's bits must not depend on the rows beside it; the loader
    checks the same with ``every_row_variant_shapes``."""
    from worker.native.quantize import Int4Linear, Int8Linear

    torch.manual_seed(0)
    module = {"int8": Int8Linear, "int4": Int4Linear}[kind](torch.randn(576, 1536) * 0.05, None, torch.bfloat16)
    module.max_rows = None
    assert batch_invariant.is_row_invariant(module, 1536, torch.bfloat16, 64, (1, 2))
    x = torch.randn(300, 1536).to(torch.bfloat16)
    every_row = module(x)
    for start, rows in [(0, 1), (7, 2), (40, 100), (1, 299)]:
        assert torch.equal(module(x[start : start + rows]), every_row[start : start + rows])
