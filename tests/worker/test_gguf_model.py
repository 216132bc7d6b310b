"""GGUF files served as they are (``worker/native/gguf_model.py``): a Qwen3-MoE file computes what
transformers computes from the same file, with its tokenizer and chat template; the default
model's file gives the bits of its converted checkpoint; a MoE request's text is the same alone
and among other requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support import models
from tests.support.models import default_model_dir
from tests.support.qwen import qwen3_tokenizer_dir, tiny_qwen3_moe_gguf
from tests.worker.engine_helpers import RunnerSeq
from tests.worker.test_determinism import Spec, _alone, _engine, _run
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import PrefillChunk
from worker.models.loader import LoadedModel, ModelLoadError, load_model, locate_default_gguf
from worker.native import exact
from worker.native.experts import ExactExperts
from worker.native.gguf_file import GGUFFile, StringArray
from worker.native.gguf_groups import Int4Groups, read_groups
from worker.native.kv_cache import KVCacheLayout, SlotKVCache

pytestmark = pytest.mark.skipif(not exact.available(), reason="GGUF files are served on the exact kernels")
# Where the files' tokenizers are converted, once (transformers takes ~10 s for Qwen's vocabulary).
_CACHE = models.test_cache_dir() / "gguf-tokenizers"


@pytest.fixture(scope="module")
def moe_file() -> Path:
    return tiny_qwen3_moe_gguf()


@pytest.fixture(scope="module")
def moe(moe_file: Path) -> LoadedModel:
    return load_model(str(moe_file), _CACHE, "cpu", "bfloat16", 512, deterministic=True)


def _prefill_logits(loaded: LoadedModel, prompt: list[int], dtype: torch.dtype) -> torch.Tensor:
    layout = KVCacheLayout.from_config(loaded.model.config, dtype, torch.device("cpu"))
    runner = ModelRunner(loaded.model, SlotKVCache(layout, 1, 64))
    return runner.prefill([PrefillChunk(RunnerSeq(prompt, 0), 0, len(prompt))])[0]  # type: ignore[arg-type]


def test_a_moe_file_computes_what_transformers_computes_from_it(moe_file: Path) -> None:
    loaded = load_model(str(moe_file), _CACHE, "cpu", "float32", 512, deterministic=True)
    spec = loaded.model.config
    assert spec.moe is not None and (spec.moe.num_experts, spec.moe.top_k, spec.moe.norm_topk_prob) == (16, 4, True)
    reference = AutoModelForCausalLM.from_pretrained(moe_file.parent / "transformers", dtype=torch.float32).eval()
    prompt = list(range(1000, 1040))
    ours = _prefill_logits(loaded, prompt, torch.float32)
    with torch.inference_mode():
        theirs = reference(torch.tensor([prompt])).logits[0, -1]
    # Stated tolerance: the exact kernels quantize activations to 8 bits per group of 32, and the
    # router and head are 8-bit; measured 0.011 max on logits up to 1.5.
    assert (ours - theirs).abs().max() < 0.05
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.999
    assert ours.argmax() == theirs.argmax()


def test_a_moe_file_brings_its_tokenizer_and_chat_template(moe: LoadedModel) -> None:
    own = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    messages = [{"role": "user", "content": "Rename foo to bar <think> in x.py"}]
    assert moe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == (
        own.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    )
    assert moe.eos_token_ids >= {own.convert_tokens_to_ids("<|im_end|>")}


def test_a_moe_files_experts_are_its_own_4_bit_groups(moe: LoadedModel, moe_file: Path) -> None:
    tensor = GGUFFile(moe_file).tensors["blk.1.ffn_down_exps.weight"]
    file_groups = read_groups(np.asarray(tensor.data[3]), "Q4_K", (256, 256))
    assert isinstance(file_groups, Int4Groups)
    layer = moe.model.model.decoder_layers()[1]
    assert layer.exact is not None and isinstance(layer.exact.mlp, ExactExperts)
    packed = layer.exact.mlp.down[3]
    assert packed.bits == 4
    assert torch.equal(exact.unpack(packed), file_groups.dequantize())


def test_the_file_reader_reads_what_gguf_py_reads() -> None:
    from gguf import GGUFReader

    path = locate_default_gguf()
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    header = {name for name in theirs.fields if name.startswith("GGUF.")}  # gguf-py's own entries
    assert set(ours.fields) == set(theirs.fields) - header
    for name, value in ours.fields.items():
        field = theirs.fields[name]
        if isinstance(value, StringArray):
            assert value.count == len(field.data)
        else:
            assert np.array_equal(np.asarray(value), np.asarray(field.contents()))
    assert len(ours.tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type == tensor.tensor_type and mine.shape == tuple(int(n) for n in reversed(tensor.shape))
        assert np.array_equal(mine.data, tensor.data)


def test_a_moe_requests_text_is_the_same_alone_and_among_others(moe: LoadedModel) -> None:
    batch = [
        Spec(tuple(range(2000 + 7 * i, 2027 + 16 * i)), 12, seed=None if i % 2 else i, temperature=1.0, top_k=0)
        for i in range(6)
    ]
    expected = _alone(moe, batch)
    engine, collector = _engine(moe, step_tokens=48, prefix_cache=True)
    arrivals = [(i, spec.request(f"r{i}")) for i, spec in enumerate(batch)]
    _run(engine, collector, arrivals)
    assert [request.sequences[0].output_token_ids for _, request in arrivals] == expected


def test_the_default_models_file_gives_the_bits_of_its_conversion(tmp_path: Path) -> None:
    from_file = load_model(str(locate_default_gguf()), _CACHE, "cpu", "auto", 512, deterministic=True)
    converted = load_model(str(default_model_dir()), tmp_path, "cpu", "auto", 512, deterministic=True)
    prompt = list(range(100, 160))
    assert torch.equal(
        _prefill_logits(from_file, prompt, torch.bfloat16), _prefill_logits(converted, prompt, torch.bfloat16)
    )


def test_a_gguf_file_needs_the_exact_kernels(moe_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="--deterministic on"):
        load_model(str(moe_file), tmp_path, "cpu", "auto", 512, deterministic=False)


def _tiny_file(path: Path, architecture: str, extra: tuple[str, ...] = ()) -> Path:
    """A file with a one-layer decoder's metadata and tensors (random, F32), and ``extra`` tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    shapes = {
        "token_embd.weight": (50, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
        "blk.0.ffn_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
        "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32), "blk.0.ffn_gate.weight": (64, 32),
        "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64), **{name: (8,) for name in extra},
    }  # fmt: skip
    for name, shape in shapes.items():
        writer.add_tensor(name, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("architecture", "extra", "reason"),
    [
        ("gemma3", (), "GGUF architecture 'gemma3'"),
        ("llama", ("rope_freqs.weight",), r"scaled RoPE \(rope_freqs\)"),
        ("qwen2", ("blk.0.attn_gate.weight",), "unexpected tensor 'blk.0.attn_gate.weight' for a qwen2 decoder"),
    ],
)
def test_what_a_file_holds_that_the_decoder_does_not_implement_is_refused_by_name(
    tmp_path: Path, architecture: str, extra: tuple[str, ...], reason: str
) -> None:
    path = _tiny_file(tmp_path / "m.gguf", architecture, extra)
    with pytest.raises(ModelLoadError, match=reason):
        load_model(str(path), tmp_path, "cpu", "auto", None, deterministic=True)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_model(str(path), tmp_path, "cpu", "auto", None, deterministic=True)


def test_a_truncated_file_is_refused(moe_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(moe_file.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="is truncated or malformed"):
        load_model(str(path), tmp_path, "cpu", "auto", None, deterministic=True)
