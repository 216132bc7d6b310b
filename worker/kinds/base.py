"""What every worker kind provides, and what the job runner needs of it.

A kind (generate, embed, transcribe) loads its model and builds its engine on the engine
thread, says what the registry should tell the APIs about it, and turns each claimed job into
its engine's unit of work, reading the job's own stored inputs (images, audio, the events an
earlier attempt sent) through :class:`JobInputs`. The job runner and the worker's assembly know
kinds only through these protocols."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from shared.adapters import AdapterRecord, AdapterStore
from shared.contract import AnyJob, images_of
from shared.errors import ErrorKind, RelayError
from shared.events import AnyEvent, StartEvent
from shared.job_lifecycle import Claim, JobLifecycle
from shared.registry import WorkerInfo, WorkerTask

ImageBytes = dict[str, bytes]


class Work(Protocol):
    """An engine's unit of work for one job."""

    start_event: StartEvent | None
    priority: int  # 0 interactive, 1 batch

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_completion_tokens(self) -> int: ...


W = TypeVar("W", bound=Work)
W_contra = TypeVar("W_contra", contravariant=True)


class Engine(Protocol[W_contra]):
    """An engine loop, run on the engine thread; submit and abort from any thread."""

    before_step: Callable[[], None] | None

    @property
    def max_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def submit(self, work: W_contra, /) -> None: ...

    def abort(self, request_id: str, kind: ErrorKind | None = None, message: str = "", /) -> None: ...

    def load(self) -> tuple[int, int, float, float]:
        """Running and waiting units, prefix-cache hit rate, share of the KV budget held."""
        ...

    def run_forever(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Answer:
    """A job answered without the engine (tokenize): its events after the start event, from seq 1."""

    num_prompt_tokens: int
    events: list[AnyEvent]


class JobInputs:
    """What a claimed job stored apart from its payload, read when its kind asks."""

    def __init__(self, lifecycle: JobLifecycle, claim: Claim, adapters: AdapterStore | None = None) -> None:
        self._lifecycle = lifecycle
        self.claim = claim
        self._adapters = adapters

    async def images(self, job: AnyJob) -> ImageBytes:
        """The bytes of the images the job names (stored apart from it, see ``ImageRef``)."""
        images: ImageBytes = {}
        for ref in images_of(job):
            if ref.sha256 not in images:
                data = await self._lifecycle.read_image(ref.sha256)
                if data is None:
                    raise RelayError(ErrorKind.EXPIRED, "An image of this request expired before a worker took it.")
                images[ref.sha256] = data
        return images

    async def audio(self) -> bytes:
        """A transcription window's samples (kept apart from the job, see ``Transcribe``)."""
        pcm = await self._lifecycle.read_audio(self.claim.job_id)
        if pcm is None:
            raise RelayError(ErrorKind.EXPIRED, "The audio of this job expired before a worker took it.")
        return pcm

    async def adapter(self, name: str) -> AdapterRecord:
        """The stored record of the LoRA adapter the job names (404 once it was unloaded)."""
        record = None if self._adapters is None else await self._adapters.record(name)
        if record is None:
            raise RelayError(
                ErrorKind.MODEL_NOT_FOUND, f"The adapter `{name}` does not exist (it was unloaded).", "model"
            )
        return record

    async def adapter_files(self, record: AdapterRecord) -> tuple[bytes, bytes]:
        """The adapter's PEFT files, checked against its record's digest."""
        files = None if self._adapters is None else await self._adapters.files(record)
        if files is None:
            raise RelayError(ErrorKind.MODEL_NOT_FOUND, f"The adapter `{record.name}` was unloaded.", "model")
        return files

    async def sent(self) -> list[AnyEvent] | None:
        """The events earlier attempts at the job sent, from its log; None on a first attempt."""
        if self.claim.next_seq == 0:
            return None
        return await self._lifecycle.read_log(self.claim.job_id)


class JobHandler(Protocol[W]):
    @property
    def engine(self) -> Engine[W]: ...

    async def prepare(self, job: AnyJob, inputs: JobInputs) -> W | Answer:
        """The engine's unit of work for ``job`` (its ``priority`` the job's own), or the answer
        when no engine is needed; RelayError when it cannot run here."""
        ...


@dataclass(frozen=True)
class Readiness:
    """What a started kind tells the registry beyond its record's fields, and the probes its
    heartbeat reads."""

    max_input_len: int  # tokens; 0 where inputs are not token sequences (audio windows)
    source: str  # where the weights came from, for the log
    compile_probe: Callable[[], str] | None = None
    vision_probe: Callable[[], tuple[int, int, float]] | None = None
    speculation_probe: Callable[[], tuple[int, int]] | None = None  # tokens drafted, drafted tokens kept
    # Of the engine's slots, those only a job of an API key with nothing else running takes
    # (``--fair-share-slots``); the rest are the worker's ``--max-num-seqs``.
    fair_share_slots: int = 0
    # Where placement keys go that the engine holds no more (prefix keys and the claim time that
    # named each last), called on the engine thread; None for a kind that holds none.
    follow_released_keys: Callable[[Callable[[list[tuple[str, int]]], None]], None] | None = None
    # LoRA adapters it was started with, for the worker to store in Redis before it is ready:
    # (name, config file, weights file, rank, targets).
    adapters_to_store: tuple[tuple[str, bytes, bytes, int, list[str]], ...] = ()


class WorkerKind(Protocol[W]):
    task: WorkerTask

    def start(self) -> Engine[W]:
        """Engine thread: load the model and build its engine (with its self-tests)."""
        ...

    def handler(self) -> JobHandler[W]:
        """After ``start``: what turns this kind's jobs into engine work."""
        ...

    def describe(self, info: WorkerInfo) -> Readiness:
        """After ``start``: write what this kind can do into the worker's registry record (e.g.
        English-only, vision, deterministic) and say the rest."""
        ...


def wrong_task(job: AnyJob, serves: str) -> RelayError:
    return RelayError(ErrorKind.INVALID_REQUEST, f"Model `{job.model}` serves {serves} only.", "model")
