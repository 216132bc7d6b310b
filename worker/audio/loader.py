"""Load a Whisper model for faster-whisper (CTranslate2): a named model assembled from PyPI
wheels (:mod:`worker.audio.named`) or any CTranslate2 Whisper conversion in a local folder
(``ct2-transformers-converter --model openai/whisper-small --output_dir …``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from worker.audio.named import WHISPER_MODELS, assemble_whisper
from worker.models.loader import ModelLoadError

if TYPE_CHECKING:
    from faster_whisper import WhisperModel  # type: ignore[import-untyped]  # no stubs, no py.typed

logger = logging.getLogger(__name__)

# Keys only a CTranslate2 Whisper conversion's config.json has.
_WHISPER_CONFIG_KEYS = ("alignment_heads", "suppress_ids_begin")


@dataclass
class LoadedWhisper:
    model: WhisperModel
    is_multilingual: bool
    source: str

    @property
    def languages(self) -> frozenset[str]:
        return frozenset(self.model.supported_languages)


def is_whisper_model(model: str) -> bool:
    """A named Whisper model, or a folder holding a CTranslate2 Whisper conversion."""
    if model in WHISPER_MODELS:
        return True
    config = Path(model) / "config.json"
    if not ((Path(model) / "model.bin").is_file() and config.is_file()):
        return False
    try:
        keys = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(keys, dict) and any(key in keys for key in _WHISPER_CONFIG_KEYS)


def load_whisper(model: str, cache_dir: Path, device: str, num_threads: int) -> LoadedWhisper:
    from faster_whisper import WhisperModel

    named = WHISPER_MODELS.get(model)
    if named is not None:
        folder, source = assemble_whisper(named, cache_dir), f"{model} (PyPI wheels, checked)"
    elif is_whisper_model(model):
        folder, source = Path(model), str(model)
    else:
        raise ModelLoadError(f"{model} is neither a named Whisper model nor a CTranslate2 Whisper folder")
    if device == "auto":
        import ctranslate2  # type: ignore[import-untyped]  # no stubs, no py.typed

        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    kind, _, index = device.partition(":")
    # The files hold float16, which CPUs compute in float32 (said here, not in a warning per load).
    compute_type = "float32" if kind == "cpu" else "default"
    loaded = WhisperModel(
        str(folder), device=kind, device_index=int(index or 0), compute_type=compute_type, cpu_threads=num_threads
    )
    # A named model's files are checked against its record, which says what it is; of a folder,
    # CTranslate2 tells by the vocabulary's size (English-only Whisper models have one token less).
    is_multilingual = named.is_multilingual if named is not None else bool(loaded.model.is_multilingual)
    return LoadedWhisper(loaded, is_multilingual, source)
