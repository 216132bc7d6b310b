"""``--quantization int8`` / ``int4``: the packed matmuls against the full one (and the full one past
their row limit), a quantized decoder's logits against the unquantized decoder's, and where
quantization is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from tests.worker.engine_helpers import RunnerSeq
from tests.worker.test_native_decoder import FAMILIES, SHAPE, _runner, _save
from worker.engine.scheduler import PrefillChunk
from worker.models.loader import ModelLoadError, load_model
from worker.native.decoder import Linear, NativeCausalLM
from worker.native.quantize import PACKED_MAX_ROWS, Int4Linear, Int8Linear, Quantization, quantize

KINDS = {"int8": Int8Linear, "int4": Int4Linear}
# Relative error of one matmul on Gaussian weights: ~0.6 % from int8 rounding, ~8 % from 4 bits.
MATMUL_ERROR = {"int8": 0.01, "int4": 0.1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_packed_matmul_is_close_to_the_full_one(mode: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    quantized = KINDS[mode](weight, bias, dtype)
    for shape in [(1, 1, 64), (2, 2, 64), (3, 5, 64)]:  # 1 and 4 rows: packed; 15: the full weight
        x = torch.randn(shape).to(dtype)
        out = quantized(x)
        exact = F.linear(x.float(), weight, bias)
        assert out.shape == (*shape[:2], 96) and out.dtype == dtype
        error = ((out.float() - exact).norm() / exact.norm()).item()
        if shape[0] * shape[1] > PACKED_MAX_ROWS:
            torch.testing.assert_close(out, F.linear(x, weight.to(dtype), bias.to(dtype)))
        else:
            assert 0 < error < MATMUL_ERROR[mode]  # rounded, not exact: the packed kernel ran


def test_int4_needs_input_widths_in_whole_groups() -> None:
    with pytest.raises(ValueError, match="multiples of 32"):
        Int4Linear(torch.randn(8, 48), None, torch.float32)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "llama-biases-mha-untied", "qwen3"])
def test_a_quantized_decoder_gives_nearly_the_same_logits(family: str, mode: Quantization, tmp_path: Path) -> None:
    folder = _save(FAMILIES[family], tmp_path)
    full = load_model(str(folder), tmp_path, "cpu", "float32", None, "native")
    packed = load_model(str(folder), tmp_path, "cpu", "float32", None, "native", mode)
    assert isinstance(full.model, NativeCausalLM) and isinstance(packed.model, NativeCausalLM)
    assert not any(isinstance(module, Linear) for module in packed.model.modules())  # every matmul is packed
    assert isinstance(packed.model.head, Int8Linear) and packed.model.lm_head is None  # an int4 head cost too much
    # The embedding keeps its rows (a tied head got its own int8 copy).
    torch.testing.assert_close(packed.model.model.embed_tokens.weight, full.model.model.embed_tokens.weight)
    # Prefill (many rows: the full weights) then decode steps of one row each (the packed kernel).
    prompt, continuation = list(range(3, 20)), [41, 7, 99, 5, 250, 12]
    ours = _decode_logits(packed.model, prompt, continuation)
    reference = _decode_logits(full.model, prompt, continuation)
    assert F.cosine_similarity(ours, reference, dim=-1).min().item() > (0.999 if mode == "int8" else 0.99)
    assert 0 < ((ours - reference).norm() / reference.norm()).item() < (0.03 if mode == "int8" else 0.15)


def _decode_logits(model: NativeCausalLM, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    runner = _runner(model, slots=1)
    with torch.inference_mode():
        runner.prefill([PrefillChunk(RunnerSeq(prompt, 0), 0, len(prompt))])  # type: ignore[arg-type]
        steps = [runner.decode([token], [len(prompt) + i]) for i, token in enumerate(continuation)]
    return torch.cat(steps)


def test_quantization_needs_the_native_forward_on_the_cpu(tmp_path: Path) -> None:
    folder = _save(FAMILIES["llama"], tmp_path)
    with pytest.raises(ModelLoadError, match="needs the native forward"):
        load_model(str(folder), tmp_path, "cpu", "float32", None, "transformers", "int8")
    loaded = load_model(str(folder), tmp_path, "cpu", "float32", None, "native")
    assert isinstance(loaded.model, NativeCausalLM)
    loaded.model.to("meta")
    with pytest.raises(ValueError, match="CPU only"):
        quantize(loaded.model, "int8")


def test_quantization_refuses_a_checkpoint_only_transformers_serves(tmp_path: Path) -> None:
    # Without quantization, auto falls back to transformers here; with it, the worker must not
    # start silently unquantized.
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    folder = _save(LlamaConfig(**SHAPE, rope_parameters=rope), tmp_path)
    with pytest.raises(ModelLoadError, match=r"--quantization int4 needs the native forward, which cannot serve"):
        load_model(str(folder), tmp_path, "cpu", "float32", None, "auto", "int4")
