"""LoRA adapters in the native decoder against transformers + PEFT (fp32), on the tiny test
model and the default model with adapters PEFT itself wrote: the same logits for adapted rows beside base rows (library
kernels); on the exact kernels the same bits for a row alone or in a batch mixed with the base
model and another adapter, within the exact kernels' own distance of PEFT; and what is not
served, refused by the field that asks for it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors

from shared.adapter_files import AdapterError, Update
from shared.adapters import AdapterRecord, digest
from tests.support.adapters import peft_reference, write_peft_adapter
from tests.support.models import default_model_dir, tiny_random_llama_dir
from tests.worker.engine_helpers import RunnerSeq, make_seq
from worker.adapters.cache import AdapterCache
from worker.adapters.for_model import for_model
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import PrefillChunk
from worker.native.decoder import NativeCausalLM
from worker.native.deterministic import make_exact
from worker.native.kv_cache import KVCacheLayout, SlotKVCache
from worker.native.loader import load_native
from worker.native.lora import LoraModel
from worker.native.peft_format import LoraPair, PeftAdapter, read_peft
from worker.native.spec import read_decoder_spec

PROMPTS = [list(range(100, 120)), list(range(300, 311)), list(range(50, 80))]


def _files(folder: Path) -> tuple[bytes, bytes]:
    return (folder / "adapter_config.json").read_bytes(), (folder / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every target at rank 8; and q and v alone at rank 4 (the joined q/k/v update with a hole)."""
    base, root = tiny_random_llama_dir(), tmp_path_factory.mktemp("adapters")
    return {
        "all": write_peft_adapter(base, root / "all", seed=1),
        "qv": write_peft_adapter(base, root / "qv", seed=2, rank=4, targets=("q_proj", "v_proj"), alpha=8),
    }


def _model(dtype: torch.dtype, exact: bool) -> NativeCausalLM:
    model = load_native(read_decoder_spec(tiny_random_llama_dir()), dtype, torch.device("cpu"))
    if exact:
        make_exact(model, {}, "int8")
    return model


def _ready(model: NativeCausalLM, folder: Path) -> LoraModel:
    config, weights = _files(folder)
    adapter = read_peft(config, weights)
    return for_model(model, folder.name, hashlib.sha256(weights).hexdigest(), adapter, 64, model.deterministic)


def _run(model: NativeCausalLM, rows: list[tuple[list[int], LoraModel | None]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's prompt in one prefill step, then one decode step of token 5: both steps' logits."""
    layout = KVCacheLayout.from_config(model.config, model.dtype, torch.device("cpu"))
    runner = ModelRunner(model, SlotKVCache(layout, len(rows), 64))
    seqs = [RunnerSeq(prompt, slot, adapter=adapter) for slot, (prompt, adapter) in enumerate(rows)]
    chunks = [PrefillChunk(seq, 0, len(prompt)) for seq, (prompt, _) in zip(seqs, rows, strict=True)]  # type: ignore[arg-type]
    prefill = runner.prefill(chunks)
    adapters = [adapter for _, adapter in rows]
    decode = runner.decode([5] * len(rows), [len(prompt) for prompt, _ in rows], adapters=adapters)
    return prefill, decode


def _peft_logits(folder: Path, prompt: list[int], adapted: bool = True) -> torch.Tensor:
    """PEFT's logits at the prompt's last token and at the decoded token after it (``adapted``
    False: with the adapter disabled, the base model's)."""
    reference = peft_reference(tiny_random_llama_dir(), folder)
    with torch.inference_mode():
        ids = torch.tensor([[*prompt, 5]])
        if adapted:
            return reference(ids).logits[0, -2:]
        with reference.disable_adapter():
            return reference(ids).logits[0, -2:]


def test_adapted_rows_beside_base_rows_give_pefts_logits(adapters: dict[str, Path]) -> None:
    model = _model(torch.float32, exact=False)
    ready = {name: _ready(model, folder) for name, folder in adapters.items()}
    rows = [(PROMPTS[0], ready["all"]), (PROMPTS[1], None), (PROMPTS[2], ready["qv"])]
    prefill, decode = _run(model, rows)
    for row, (folder, adapted) in enumerate(
        [(adapters["all"], True), (adapters["all"], False), (adapters["qv"], True)]
    ):
        expected = _peft_logits(folder, PROMPTS[row], adapted)
        torch.testing.assert_close(torch.stack([prefill[row], decode[row]]), expected, atol=1e-5, rtol=1e-4)
    # The adapters change the numbers (so the comparison above tests something).
    assert (
        _peft_logits(adapters["all"], PROMPTS[0]) - _peft_logits(adapters["all"], PROMPTS[0], adapted=False)
    ).abs().max() > 0.1


def test_exact_kernels_give_a_row_the_same_bits_whatever_shares_its_batch(adapters: dict[str, Path]) -> None:
    model = _model(torch.bfloat16, exact=True)
    first, second = _ready(model, adapters["all"]), _ready(model, adapters["qv"])
    alone = _run(model, [(PROMPTS[0], first)])
    second_alone = _run(model, [(PROMPTS[2], second)])
    base_alone = _run(model, [(PROMPTS[1], None)])
    # Each adapter's slice of the joined update sits first in one batch and second in the other.
    for rows in ([(PROMPTS[1], None), (PROMPTS[0], first), (PROMPTS[2], second)],
                 [(PROMPTS[2], second), (PROMPTS[1], None), (PROMPTS[0], first)]):  # fmt: skip
        mixed = _run(model, rows)
        at = {id(adapter): row for row, (_, adapter) in enumerate(rows)}
        for step in (0, 1):
            assert torch.equal(mixed[step][at[id(first)]], alone[step][0])
            assert torch.equal(mixed[step][at[id(second)]], second_alone[step][0])
            assert torch.equal(mixed[step][at[id(None)]], base_alone[step][0])  # the base model's bits, untouched
    # As close to PEFT's fp32 numbers as the exact kernels hold the base model to its own.
    base_error = (
        (_run(model, [(PROMPTS[0], None)])[0][0] - _peft_logits(adapters["all"], PROMPTS[0], adapted=False)[0])
        .abs()
        .max()
    )
    adapted_error = (alone[0][0] - _peft_logits(adapters["all"], PROMPTS[0])[0]).abs().max()
    assert adapted_error <= 2 * base_error + 1e-3, (adapted_error, base_error)


def test_the_prefix_caches_key_an_adapters_prompt_apart() -> None:
    base_seq = make_seq(prompt=[1, 2, 3])
    adapted = make_seq(prompt=[1, 2, 3])
    adapted.request.adapter = LoraModel("a", 11, (), 0)
    other = make_seq(prompt=[1, 2, 3])
    other.request.adapter = LoraModel("b", 12, (), 0)
    keys = [seq.cache_keys([1, 2, 3]) for seq in (base_seq, adapted, other)]
    assert keys[0] == [1, 2, 3]
    assert len({tuple(k) for k in keys}) == 3


def _edited(folder: Path, **changes: object) -> tuple[bytes, bytes]:
    config, weights = _files(folder)
    return json.dumps({**json.loads(config), **changes}).encode(), weights


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "bias"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 0}, "r"),
    ],
)
def test_what_is_not_served_is_refused_by_its_field(
    adapters: dict[str, Path], changes: dict[str, object], field: str
) -> None:
    with pytest.raises(AdapterError) as refused:
        read_peft(*_edited(adapters["qv"], **changes))
    assert refused.value.field == field


def test_an_adapter_that_does_not_fit_the_model_is_refused(adapters: dict[str, Path]) -> None:
    model = _model(torch.float32, exact=False)
    config, weights = _files(adapters["all"])
    adapter = read_peft(config, weights)
    with pytest.raises(AdapterError, match="over this server's --max-lora-rank 4") as refused:
        for_model(model, "all", "0" * 64, adapter, max_rank=4, exact=False)
    assert refused.value.field == "r"
    (layer, target), pair = next(iter(adapter.pairs.items()))
    wider = torch.zeros(pair.b.shape[0] * 2, pair.rank)
    update = Update("a", "b", pair.rank, pair.a.shape[1], wider.shape[0])
    pairs = {(layer, target): LoraPair(pair.a, wider, 1.0)}
    misfit = PeftAdapter(8, frozenset({target}), {(layer, target): update}, pairs)
    with pytest.raises(AdapterError, match="another base model"):
        for_model(model, "misfit", "0" * 64, misfit, max_rank=64, exact=False)
    stray = save_safetensors({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
    with pytest.raises(AdapterError, match="not a LoRA update of a decoder projection"):
        read_peft(config, stray)
    with pytest.raises(AdapterError, match="not a safetensors file"):
        read_peft(config, b"not safetensors")


@pytest.mark.real_model
@pytest.mark.slow
def test_the_default_model_with_adapters_gives_pefts_logits_and_keeps_its_bits_in_a_batch(tmp_path: Path) -> None:
    """Rank 16 on every target of SmolLM2-135M: the library forward (fp32) within 1e-3 of PEFT's
    logits; the exact forward gives an adapted row the same bits beside the base model and another
    adapter, as close to PEFT as it holds the base model."""
    base = default_model_dir()
    first = write_peft_adapter(base, tmp_path / "first", seed=1, rank=16)
    second = write_peft_adapter(base, tmp_path / "second", seed=2, rank=16, targets=("q_proj", "v_proj"))
    reference = peft_reference(base, first)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        ids = torch.tensor([[*prompt, 5]])
        expected = reference(ids).logits[0, -2:]
        with reference.disable_adapter():
            expected_base = reference(ids).logits[0, -2:]
    library = load_native(read_decoder_spec(base), torch.float32, torch.device("cpu"))
    prefill, decode = _run(library, [(prompt, _ready(library, first)), (PROMPTS[1], None)])
    torch.testing.assert_close(torch.stack([prefill[0], decode[0]]), expected, atol=1e-3, rtol=1e-3)
    exact_model = load_native(read_decoder_spec(base), torch.bfloat16, torch.device("cpu"))
    make_exact(exact_model, {}, "int8")
    adapted, other = _ready(exact_model, first), _ready(exact_model, second)
    alone = _run(exact_model, [(prompt, adapted)])
    mixed = _run(exact_model, [(PROMPTS[1], None), (PROMPTS[2], other), (prompt, adapted)])
    assert torch.equal(mixed[0][2], alone[0][0]) and torch.equal(mixed[1][2], alone[1][0])
    base_error = (_run(exact_model, [(prompt, None)])[0][0] - expected_base[0]).abs().max()
    assert (alone[0][0] - expected[0]).abs().max() <= 2 * base_error + 1e-3


def test_the_adapter_cache_reports_what_it_lets_go_with_the_latest_claim_that_ran_on_it(
    adapters: dict[str, Path],
) -> None:
    """Past ``max_loaded`` the least recently used adapter is let go, reported with the latest claim
    of a job that ran on it here (the worker then stops saying it holds the adapter ready)."""
    cache = AdapterCache(_model(torch.float32, exact=False), exact=False, max_loaded=1, max_rank=64)
    reported: list[list[tuple[str, int]]] = []
    cache.on_let_go = reported.append
    records = {}
    for name, folder in adapters.items():
        config, weights = _files(folder)
        records[name] = AdapterRecord(
            name=name, base="tiny", sha256=digest(config, weights), size=len(config) + len(weights), rank=8,
            targets=["q_proj"], created=0.0,
        )  # fmt: skip
    cache.claimed("all", 1_000)
    cache.claimed("all", 900)  # an earlier claim that started later keeps the latest
    cache.make_from_files(records["all"], *_files(adapters["all"]))
    assert cache.get(records["all"]) is not None and reported == []
    cache.claimed("qv", 2_000)
    cache.make_from_files(records["qv"], *_files(adapters["qv"]))
    assert reported == [[("all", 1_000)]]
    assert cache.get(records["all"]) is None and cache.get(records["qv"]) is not None
    cache.make_from_files(records["all"], *_files(adapters["all"]))  # made ready again without a claim
    assert reported[-1] == [("qv", 2_000)]
