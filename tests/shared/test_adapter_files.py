"""PEFT adapter files read without torch (what the API checks before storing an adapter): a real
PEFT adapter reads as its tensors say; any bytes at all are either read or refused with an
``AdapterError`` naming the file or field, never another exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.adapter_files import AdapterError, ModelShapes, check_fits, read_adapter, read_config, tensor_shapes
from tests.support.adapters import write_peft_adapter
from tests.support.models import tiny_random_llama_dir

TINY = ModelShapes(
    num_layers=2,
    shapes={"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
            "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)},
)  # fmt: skip


@pytest.fixture(scope="module")
def peft_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    folder = write_peft_adapter(tiny_random_llama_dir(), tmp_path_factory.mktemp("adapter") / "a", seed=1, rank=4,
                                targets=("q_proj", "down_proj"))  # fmt: skip
    return (folder / "adapter_config.json").read_bytes(), (folder / "adapter_model.safetensors").read_bytes()


def test_a_peft_adapter_reads_as_its_tensors_say(peft_files: tuple[bytes, bytes]) -> None:
    config, updates = read_adapter(*peft_files)
    assert config.rank == 4 and config.scaling(4) == 16 / 4
    assert sorted(updates) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"), (1, "q_proj")]
    down = updates[(1, "down_proj")]
    assert (down.rank, down.in_features, down.out_features) == (4, 128, 64)
    check_fits(updates, TINY)
    with pytest.raises(AdapterError, match="--max-lora-rank 2") as refused:
        check_fits(updates, TINY.model_copy(update={"max_rank": 2}))
    assert refused.value.field == "r"
    with pytest.raises(AdapterError, match="mixture of experts"):
        check_fits(updates, TINY.model_copy(update={"sparse_layers": [1]}))
    with pytest.raises(AdapterError, match="the model has 1 layers"):
        check_fits(updates, TINY.model_copy(update={"num_layers": 1}))


def test_rslora_scales_by_the_square_root_of_the_rank(peft_files: tuple[bytes, bytes]) -> None:
    config = read_config(json.dumps({**json.loads(peft_files[0]), "use_rslora": True}).encode())
    assert config.scaling(4) == 16 / 2


@given(st.binary(max_size=200))
def test_any_bytes_are_read_or_refused_as_weights(data: bytes) -> None:
    try:
        tensor_shapes(data)
    except AdapterError as exc:
        assert exc.field == "adapter_model.safetensors"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = st.sampled_from(["r", "lora_alpha", "target_modules", "peft_type", "use_dora", "bias", "use_rslora"])


@given(st.dictionaries(_FIELDS, _JSON, max_size=7))
def test_any_config_is_read_or_refused_by_a_field(config: dict[str, object]) -> None:
    try:
        read_config(json.dumps(config).encode())
    except AdapterError as exc:
        assert exc.field in {
            "r",
            "lora_alpha",
            "target_modules",
            "peft_type",
            "use_dora",
            "bias",
            "adapter_config.json",
        }


def test_a_target_list_that_is_not_one_is_refused() -> None:
    with pytest.raises(AdapterError) as refused:
        read_config(json.dumps({"r": 4, "target_modules": 7}).encode())
    assert refused.value.field == "target_modules"


def test_a_header_that_runs_past_the_file_is_refused() -> None:
    with pytest.raises(AdapterError, match="runs past the end"):
        tensor_shapes((10**6).to_bytes(8, "little") + b"{}")
