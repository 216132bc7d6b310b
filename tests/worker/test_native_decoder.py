"""The native decoder against transformers' own implementation, on tiny random-weight models of
each family it serves (fp32): the same logits through the engine's runner (prompt chunks of
unequal length in one step, then decode steps) and the same greedy tokens as ``generate``; and
what it refuses, it leaves to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.support.models import tiny_random_llama_dir
from tests.worker.engine_helpers import RunnerSeq
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import PrefillChunk
from worker.models.loader import ModelLoadError, load_model
from worker.native.decoder import NativeCausalLM, RMSNorm
from worker.native.kv_cache import KVCacheLayout, SlotKVCache
from worker.native.loader import load_native
from worker.native.spec import UnsupportedCheckpoint, read_decoder_spec

SHAPE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _experts(count: int, per_token: int, width: int, renormalised: bool) -> dict[str, object]:
    return {"num_experts": count, "num_experts_per_tok": per_token, "moe_intermediate_size": width,
            "norm_topk_prob": renormalised}  # fmt: skip


FAMILIES: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "llama-biases-mha-untied": LlamaConfig(
        **{**SHAPE, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True, tie_word_embeddings=False
    ),
    "mistral": MistralConfig(**SHAPE, sliding_window=None),
    "qwen2": Qwen2Config(**SHAPE, tie_word_embeddings=False),
    "qwen3": Qwen3Config(**SHAPE, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # 8 experts, 2 a token, the second layer dense; and Qwen3-30B-A3B's routing (8 a token,
    # renormalised) over 16 experts.
    "qwen3_moe": Qwen3MoeConfig(**SHAPE, head_dim=32, **_experts(8, 2, 48, renormalised=False), mlp_only_layers=[1]),
    "qwen3_moe-top8": Qwen3MoeConfig(**SHAPE, head_dim=16, **_experts(16, 8, 32, renormalised=True)),
}


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _save(config: PretrainedConfig, folder: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint, with the tiny test model's tokenizer beside it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.uniform_(0.5, 1.5) if name.endswith("norm.weight") else param.normal_(0, 0.5)
    model.save_pretrained(folder)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(tiny_random_llama_dir() / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(FAMILIES[request.param], tmp_path_factory.mktemp(request.param))


def _reference(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


def _runner(model: NativeCausalLM, slots: int = 3) -> ModelRunner:
    layout = KVCacheLayout.from_config(model.config, torch.float32, torch.device("cpu"))
    return ModelRunner(model, SlotKVCache(layout, slots, 64))


def test_prefill_and_decode_logits_match_transformers(checkpoint: Path) -> None:
    reference = _reference(checkpoint)
    runner = _runner(load_native(read_decoder_spec(checkpoint), torch.float32, torch.device("cpu")))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (11, 4)]
    seqs = [RunnerSeq(prompt, slot) for slot, prompt in enumerate(prompts)]
    # Row 0 in two chunks (the second beside row 1's whole, shorter prompt); then two decode steps.
    runner.prefill([PrefillChunk(seqs[0], 0, 6)])  # type: ignore[arg-type]
    last = runner.prefill([PrefillChunk(seqs[0], 6, 5), PrefillChunk(seqs[1], 0, 4)])  # type: ignore[arg-type]
    steps = [last]
    nexts = [[7, 9], [3, 5]]
    for step, tokens in enumerate(nexts):
        steps.append(runner.decode(tokens, [len(prompts[0]) + step, len(prompts[1]) + step]))
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            full = torch.tensor([prompt + [tokens[row] for tokens in nexts]])
            logits = reference(full).logits[0, len(prompt) - 1 :]
            ours = torch.stack([step[row] for step in steps])
            torch.testing.assert_close(ours, logits, atol=1e-5, rtol=1e-4)


def test_greedy_tokens_through_the_engine_equal_generate(checkpoint: Path) -> None:
    loaded = load_model(str(checkpoint), Path("/nonexistent"), "cpu", "float32", 128, model_impl="native")
    assert isinstance(loaded.model, NativeCausalLM)
    reference = _reference(checkpoint)
    prompt = list(range(5, 25))
    runner = _runner(loaded.model, slots=1)
    logits = runner.prefill([PrefillChunk(RunnerSeq(prompt, 0), 0, len(prompt))])  # type: ignore[arg-type]
    ours: list[int] = []
    for _ in range(12):
        ours.append(int(logits[0].argmax()))
        logits = runner.decode([ours[-1]], [len(prompt) + len(ours) - 1])
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert ours == out[0, len(prompt) :].tolist()


def _edit_config(folder: Path, **changes: object) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope type 'llama3'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        ({"model_type": "gpt_neox"}, "model type 'gpt_neox'"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding-window attention"),
        ({"pretraining_tp": 2}, "pretraining_tp > 1"),
    ],
)
def test_what_the_native_decoder_does_not_implement_is_refused_by_name(
    tmp_path: Path, changes: dict[str, object], reason: str
) -> None:
    folder = _edit_config(_save(FAMILIES["llama"], tmp_path), **changes)
    with pytest.raises(UnsupportedCheckpoint, match=reason):
        read_decoder_spec(folder)


def test_auto_falls_back_to_transformers_and_native_says_why_not(tmp_path: Path) -> None:
    # A llama3-scaled RoPE: transformers implements it, the native decoder does not.
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    folder = _save(LlamaConfig(**SHAPE, rope_parameters=rope), tmp_path)
    loaded = load_model(str(folder), tmp_path, "cpu", "float32", None, model_impl="auto")
    assert not isinstance(loaded.model, NativeCausalLM)
    assert loaded.vocab_size == SHAPE["vocab_size"]
    with pytest.raises(ModelLoadError, match=r"--model-impl native cannot serve .*rope type 'llama3'"):
        load_model(str(folder), tmp_path, "cpu", "float32", None, model_impl="native")


def test_a_checkpoint_with_weights_the_decoder_lacks_is_refused(tmp_path: Path) -> None:
    folder = _save(FAMILIES["llama"], tmp_path)
    spec = read_decoder_spec(_edit_config(folder, num_hidden_layers=1))
    with pytest.raises(UnsupportedCheckpoint, match=r"unexpected weight 'model\.layers\.1"):
        load_native(spec, torch.float32, torch.device("cpu"))
    spec = read_decoder_spec(_edit_config(folder, num_hidden_layers=3))
    with pytest.raises(UnsupportedCheckpoint, match=r"lacks .* weights"):
        load_native(spec, torch.float32, torch.device("cpu"))


def test_eos_ids_are_the_generation_configs_and_the_tokenizers(checkpoint: Path) -> None:
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    loaded = load_model(str(checkpoint), Path("/nonexistent"), "cpu", "float32", None)
    assert isinstance(loaded.model, NativeCausalLM)
    assert loaded.eos_token_ids == {7, 9, loaded.tokenizer.eos_token_id}
    assert loaded.max_model_len == SHAPE["max_position_embeddings"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_identical_to_transformers_formula(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight = torch.nn.Parameter(torch.rand(96).to(dtype) + 0.5)
    for shape in [(1, 1, 96), (3, 7, 96), (2, 5, 4, 96)]:
        hidden = (torch.randn(shape) * 3).to(dtype)
        as_float = hidden.float()
        reference = norm.weight * (as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(norm(hidden), reference)
