"""Worker kinds, one per task: the only place a task is chosen and dispatched on.

``generate`` (chat, completions, tokenize), ``embed`` (embeddings) and ``transcribe`` (Whisper
windows). ``--task auto`` picks from the model: a Whisper model transcribes, a sentence encoder
embeds, anything else generates."""

from __future__ import annotations

from typing import Any

from shared.registry import WorkerTask
from worker.audio.loader import is_whisper_model
from worker.embedding.loader import is_embedding_model
from worker.engine.engine import OutputSink
from worker.kinds.base import WorkerKind
from worker.kinds.embed import EmbedKind
from worker.kinds.generate import GenerateKind
from worker.kinds.transcribe import TranscribeKind
from worker.settings import WorkerSettings


def resolve_task(settings: WorkerSettings) -> WorkerTask:
    if settings.task != "auto":
        return settings.task
    if is_whisper_model(settings.model):
        return "transcribe"
    return "embed" if is_embedding_model(settings.model) else "generate"


def make_kind(settings: WorkerSettings, sink: OutputSink, num_threads: int) -> WorkerKind[Any]:
    """``num_threads``: the engine's thread count at load (a kind whose library fixes it then reads it)."""
    task = resolve_task(settings)
    if task == "embed":
        return EmbedKind(settings, sink)
    if task == "transcribe":
        return TranscribeKind(settings, sink, num_threads)
    return GenerateKind(settings, sink)
