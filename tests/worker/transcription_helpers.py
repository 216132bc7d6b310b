"""Running the transcription engine on its own thread and collecting what it sends, per window."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
from faster_whisper.transcribe import Segment  # type: ignore[import-untyped]  # no stubs, no py.typed

from shared.contract import Transcribe, TranscriptionJob
from shared.events import AnyEvent, StartEvent
from worker.audio.engine import TranscriptionEngine, TranscriptionWork, WindowResume
from worker.audio.loader import LoadedWhisper
from worker.engine.engine import RequestOutput


def transcription_job(model: str, *, job_id: str = "tr-1", **fields: object) -> TranscriptionJob:
    request = Transcribe(model=model, window=0, num_windows=1, offset_s=0.0, duration_s=1.0, **fields)  # type: ignore[arg-type]
    return TranscriptionJob(job_id=job_id, created=0, request=request)


def window_work(
    model: str, samples: np.ndarray, *, job_id: str = "tr-1", resume: WindowResume | None = None, **fields: object
) -> TranscriptionWork:
    """A first attempt (with its start event), or one continuing ``resume``."""
    job = transcription_job(model, job_id=job_id, **fields)
    start = StartEvent(seq=0, worker_id="w", prompt_tokens=0) if resume is None else None
    work = TranscriptionWork(job_id, job.request, samples.astype(np.float32), start_event=start)
    if resume is not None:
        work.continue_from(resume)
    return work


TEXTS = (" One.", " Two.", " Three.")


class StandInModel:
    """Yields ``TEXTS`` as segments lazily, waiting on ``gate`` before each one after the first
    (so a test can abort between segments); ``fail`` makes ``transcribe`` raise."""

    def __init__(self, is_multilingual: bool = False) -> None:
        self.supported_languages = ["en", "de", "es"] if is_multilingual else ["en"]
        self.fail = False
        self.gate: threading.Event | None = None
        self.calls: list[dict[str, Any]] = []

    def transcribe(self, samples: np.ndarray, **options: Any) -> tuple[Iterator[Segment], SimpleNamespace]:
        self.calls.append(options)
        if self.fail:
            raise RuntimeError("decoder exploded")
        return self._segments(), SimpleNamespace(language="en", language_probability=1.0)

    def _segments(self) -> Iterator[Segment]:
        for index, text in enumerate(TEXTS):
            if index > 0 and self.gate is not None:
                self.gate.wait(timeout=10)
            tokens = [100 + index, 200 + index]
            yield Segment(index, 0, float(index), index + 1.0, text, tokens, -0.1, 1.2, 0.01, None, 0.0)


def stand_in_whisper(is_multilingual: bool = False) -> LoadedWhisper:
    return LoadedWhisper(StandInModel(is_multilingual), is_multilingual, "stand-in")


class EngineRun:
    """The engine on a thread; ``outputs`` returns each window's outputs once it is done."""

    def __init__(self, whisper: LoadedWhisper) -> None:
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.engine = TranscriptionEngine(whisper, self._sink)
        self._thread = threading.Thread(target=self.engine.run_forever, daemon=True)
        self._thread.start()

    def _sink(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._outputs.put(output)

    def outputs(self, work: TranscriptionWork, timeout_s: float = 120.0) -> list[RequestOutput]:
        self.engine.submit(work)
        collected: list[RequestOutput] = []
        while not (collected and collected[-1].is_done):
            output = self._outputs.get(timeout=timeout_s)
            assert output.request_id == work.request_id
            collected.append(output)
        return collected

    def stop(self) -> None:
        self.engine.stop()
        self._thread.join(timeout=5)


def events_of(outputs: list[RequestOutput]) -> list[AnyEvent]:
    return [event for output in outputs for event in output.events]
