"""A request inside the engine, and its choices: each a ``Sequence`` whose tokens every concern
reads, and beside them one state object per concern, defined next to nothing but its own data
(``sched``: scheduler.py, ``prefix``: shared_prefix.py, ``output``: output_processor.py,
``sampling``: sampler.py, ``draft``: drafter.py), so the concern that changes a field is the one its object names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.events import StartEvent
from worker.engine.detokenizer import Decoder
from worker.engine.drafter import DraftState
from worker.engine.output_state import OutputState
from worker.engine.prefix_state import PrefixLink
from worker.engine.prompt_images import PromptImages
from worker.engine.sampling_params import SamplingParams
from worker.engine.sampling_state import SequenceSampling
from worker.engine.scheduling_state import SchedulingState
from worker.native.lora import LoraModel
from worker.parsers.pipeline import TextPipeline
from worker.structured import CompiledConstraint


@dataclass(frozen=True)
class ResumeState:
    """A job's earlier attempt, read from its event log: where to continue."""

    next_event_seq: int
    output_token_ids: dict[int, list[int]]  # choice index -> tokens already sent
    finished_choices: frozenset[int]


@dataclass(frozen=True)
class PrefixKeys:
    """A job's placement keys (``shared.placement``) and when this worker claimed it (ms): the
    worker says it holds them while its prefix cache holds the job's prompt (``held_prefixes.py``)."""

    keys: tuple[str, ...]
    claimed_ms: int


@dataclass
class EngineRequest:
    """One job: its prompts (one for chat, one or more for completions), its settings, and
    ``num_choices`` sequences per prompt, all sharing one event counter."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    num_choices: int = 1  # per prompt
    start_event: StartEvent | None = None  # made by the job, sent by the engine so it precedes every delta
    resume: ResumeState | None = None  # what an earlier attempt already sent
    make_pipeline: Callable[[], TextPipeline] | None = None  # reasoning / tool-call parsing per choice
    constraint: CompiledConstraint | None = None  # a grammar the output must follow
    # -1 a quiet API key's (a slot kept for it), 0 interactive, 1 batch: waiting requests are
    # admitted in this order
    priority: int = 0
    images: PromptImages | None = None  # a chat prompt's images (one prompt, vision models)
    prefix_keys: PrefixKeys | None = None  # the job's placement keys, held while its prompt is cached
    adapter: LoraModel | None = None  # a LoRA adapter over the base model (worker/native/lora.py)
    next_event_seq: int = 1  # 0 is the start event
    num_finished: int = 0
    num_completion_tokens: int = 0
    sequences: list[Sequence] = field(default_factory=list)

    def take_event_seq(self) -> int:
        seq = self.next_event_seq
        self.next_event_seq += 1
        return seq

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.num_choices

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt (by its first choice)."""
        return sum(seq.sched.num_cached_tokens for seq in self.sequences if seq.index % self.num_choices == 0)

    @property
    def is_finished(self) -> bool:
        return self.num_finished == self.num_sequences


class Sequence:
    """One choice of a request: its tokens, and the state of each concern that works on it."""

    def __init__(self, request: EngineRequest, index: int, prompt_token_ids: list[int], tokenizer: Decoder) -> None:
        self.request = request
        self.index = index  # the choice index the client sees: prompt number * n + choice
        self.params = request.params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.sched = SchedulingState(prompt_token_ids)  # scheduler.py: status, slot, KV held
        self.prefix = PrefixLink()  # shared_prefix.py: the prefix slots it reads and extends
        self.output = OutputState(self.params, tokenizer, request.make_pipeline)  # output_processor.py
        self.sampling = SequenceSampling(self.params, index, request.constraint)  # sampler.py
        self.draft = DraftState()  # drafter.py: its guesses at the tokens to come, and how they fared

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1]

    def cache_keys(self, token_ids: list[int]) -> list[int]:
        """What the prefix caches hash for ``token_ids`` (this sequence's prompt, then outputs):
        the ids themselves, with image placeholders named by their image (``prompt_images.py``),
        each combined with the adapter's key where the request has one."""
        images, adapter = self.request.images, self.request.adapter
        keys = token_ids if images is None else images.keyed(token_ids)
        if adapter is not None:  # an adapter's keys and values are its own: never shared with another's
            keys = [hash((adapter.key, key)) for key in keys]
        return keys
