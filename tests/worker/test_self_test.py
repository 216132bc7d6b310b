"""The load-time self-test a worker runs before it promises deterministic text
(``worker/engine/self_test.py``), and where the loader keeps the promise or gives it up."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.support.models import tiny_random_llama_dir
from tests.support.qwen import tiny_random_qwen3_dir, tiny_random_qwen3_moe_dir
from worker.engine import self_test
from worker.engine.self_test import PassedSelfTests, SelfTestResult, check_determinism
from worker.models.loader import LoadedModel, load_model
from worker.native import exact
from worker.native.decoder import NativeCausalLM

pytestmark = pytest.mark.skipif(not exact.available(), reason="the exact kernels need a C++ compiler")


@pytest.fixture(scope="module")
def folder() -> Path:
    return tiny_random_llama_dir(seed=5, hidden_size=128, num_layers=2)


@pytest.fixture(scope="module")
def deterministic(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    cache = tmp_path_factory.mktemp("cache")
    return load_model(str(folder), cache, "cpu", "bfloat16", 512, "native", "auto", deterministic=True)


def test_the_exact_kernels_pass_it(deterministic: LoadedModel) -> None:
    assert isinstance(deterministic.model, NativeCausalLM) and deterministic.model.deterministic
    result = check_determinism(deterministic.model, deterministic.tokenizer, deterministic.eos_token_ids, {1, 2})
    assert result.holds, result.detail
    assert "together" in result.detail and "[1, 2]" in result.detail


def test_logits_that_depend_on_the_batch_fail_it(deterministic: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward whose logits shift with the number of rows in the step (what a library kernel
    choosing its blocking by row count does) is caught, and what differed is said."""
    model = deterministic.model
    assert isinstance(model, NativeCausalLM)
    logits = model.logits

    def by_row_count(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        return out + 0.5 * (hidden.shape[0] > 1) * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))

    monkeypatch.setattr(model, "logits", by_row_count)
    result = check_determinism(model, deterministic.tokenizer, deterministic.eos_token_ids, {1})
    assert not result.holds
    assert "all at once" in result.detail and "differ from their run alone" in result.detail


def test_a_thread_count_that_changes_bits_fails_it(deterministic: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    model = deterministic.model
    assert isinstance(model, NativeCausalLM)
    logits = model.logits
    threads = torch.get_num_threads()

    def by_threads(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        return out if torch.get_num_threads() == threads else out.roll(1, dims=-1)

    monkeypatch.setattr(model, "logits", by_threads)
    result = check_determinism(model, deterministic.tokenizer, deterministic.eos_token_ids, {threads + 1})
    assert not result.holds and f"at {threads + 1} threads" in result.detail


def test_quantization_none_keeps_the_library_kernels_and_says_the_promise_is_off(
    folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.models.loader"):
        loaded = load_model(str(folder), tmp_path, "cpu", "bfloat16", 512, "native", "none", deterministic=True)
    assert isinstance(loaded.model, NativeCausalLM) and not loaded.model.deterministic
    assert "--deterministic on cannot hold" in caplog.text and "--quantization none" in caplog.text


def test_a_qwen3_model_with_query_and_key_norms_passes_it(tmp_path: Path) -> None:
    """Qwen3's per-head q/k RMSNorms run on the exact kernels too."""
    loaded = load_model(str(tiny_random_qwen3_dir()), tmp_path, "cpu", "bfloat16", 512, "native", "auto", True)
    assert isinstance(loaded.model, NativeCausalLM) and loaded.model.deterministic
    assert loaded.model.model.layers[0].self_attn.q_norm is not None
    result = check_determinism(loaded.model, loaded.tokenizer, loaded.eos_token_ids, {1, 2})
    assert result.holds, result.detail


def test_a_mixture_of_experts_passes_it(tmp_path: Path) -> None:
    """Router, expert grouping and the weighted sum run on the exact kernels: a token's experts and
    bits do not depend on the tokens routed beside it."""
    loaded = load_model(str(tiny_random_qwen3_moe_dir()), tmp_path, "cpu", "bfloat16", 512, "native", "auto", True)
    assert isinstance(loaded.model, NativeCausalLM) and loaded.model.deterministic
    assert loaded.model.config.moe is not None
    result = check_determinism(loaded.model, loaded.tokenizer, loaded.eos_token_ids, {1, 2})
    assert result.holds, result.detail


def test_a_pass_is_remembered_under_the_weights_code_cpu_and_thread_counts(
    deterministic: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes = PassedSelfTests(tmp_path)
    key = passes.key(deterministic.model, {1, 2})
    assert passes.passed(key) is None
    passes.remember(key, SelfTestResult(True, 3.5, "16 requests alone, together and at threads [1, 2]"))
    assert PassedSelfTests(tmp_path).passed(key) == SelfTestResult(
        True, 3.5, "16 requests alone, together and at threads [1, 2]"
    )
    assert passes.key(deterministic.model, {1, 2}) == key
    # Other thread counts, other code, another CPU or other weights: another key, not tested yet.
    assert passes.key(deterministic.model, {1, 3}) != key
    with monkeypatch.context() as patch:
        patch.setattr(self_test, "code_digest", lambda: "other code")
        assert passes.key(deterministic.model, {1, 2}) != key
    with monkeypatch.context() as patch:
        patch.setattr(self_test, "machine_digest", lambda: "other cpu")
        assert passes.key(deterministic.model, {1, 2}) != key
    other = load_model(
        str(tiny_random_llama_dir(seed=6, hidden_size=128, num_layers=2)), tmp_path, "cpu", "bfloat16", 512,
        "native", "auto", deterministic=True,
    )  # fmt: skip
    assert passes.key(other.model, {1, 2}) != key
    # The exact kernels' packed weights are outside the parameters: a change there is another key too.
    layer = deterministic.model.model.decoder_layers()[0]
    assert layer.exact is not None
    data = layer.exact.o.packed.data
    data[-1] ^= 1
    try:
        assert passes.key(deterministic.model, {1, 2}) != key
    finally:
        data[-1] ^= 1


def test_a_failure_is_not_remembered_and_an_unreadable_record_is_no_pass(tmp_path: Path) -> None:
    passes = PassedSelfTests(tmp_path)
    passes.remember("exact-failed", SelfTestResult(False, 1.0, "all at once: requests [0] of 16 differ"))
    assert passes.passed("exact-failed") is None
    (tmp_path / "self-test").mkdir(exist_ok=True)
    (tmp_path / "self-test" / "exact-torn.json").write_text('{"seconds": 1.')
    assert passes.passed("exact-torn") is None
