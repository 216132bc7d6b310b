"""Request and per-choice sequence state inside the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum, auto
from typing import TYPE_CHECKING

from shared.events import StartEvent
from worker.engine.detokenizer import Decoder, IncrementalDetokenizer
from worker.engine.sampling_params import SamplingParams
from worker.engine.stop_checker import StopStringChecker
from worker.parsers.pipeline import TextPipeline
from worker.structured import CompiledConstraint

if TYPE_CHECKING:
    from worker.engine.shared_prefix import PrefixSlot


class FinishReason(StrEnum):
    """Why a choice ended, as the OpenAI API names it."""

    STOP = "stop"  # EOS, a stop token or string, or a grammar that cannot go on
    LENGTH = "length"  # max_tokens, or the context is full
    TOOL_CALLS = "tool_calls"  # stopped after calling tools


class SequenceStatus(Enum):
    WAITING = auto()  # admitted to the engine, no slot yet
    PREFILLING = auto()  # has a slot; prompt partly in the KV cache
    DECODING = auto()  # prompt cached; one token per step
    FINISHED = auto()


@dataclass(frozen=True)
class ResumeState:
    """A job's earlier attempt, read from its event log: where to continue."""

    next_event_seq: int
    output_token_ids: dict[int, list[int]]  # choice index -> tokens already sent
    finished_choices: frozenset[int]


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
    priority: int = 0  # 0 interactive, 1 batch: waiting requests are admitted in this order
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
        return sum(seq.num_cached_tokens for seq in self.sequences if seq.index % self.num_choices == 0)

    @property
    def is_finished(self) -> bool:
        return self.num_finished == self.num_sequences


class Sequence:
    """One choice of a request: token ids, KV slot, text pipeline and random generator."""

    def __init__(self, request: EngineRequest, index: int, prompt_token_ids: list[int], tokenizer: Decoder) -> None:
        self.request = request
        self.index = index  # the choice index the client sees: prompt number * n + choice
        self.params = request.params
        self.prompt_token_ids = prompt_token_ids
        # What prefill puts in the KV cache: the prompt, plus the tokens already sent when the
        # sequence resumes a job whose first worker died.
        self.prefill_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.unsent_token_ids: list[int] = []  # generated since the last delta event
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.num_kv_blocks = 0  # KV blocks held in its own slot (kv_blocks.py)
        # A prompt prefix it reads from a prefix slot instead of holding (shared_prefix.py): its
        # first ``shared_len`` tokens, which its own slot then does not hold.
        self.shared_prefix: PrefixSlot | None = None
        self.shared_len = 0
        # The chain its first ``chain_len`` tokens are cached in (read, copied from or published
        # to): where its later blocks are published, extending that chain in place.
        self.chain: PrefixSlot | None = None
        self.chain_len = 0
        self.chain_hash = 0  # the hash of its last block there: is the chain still its own?
        # Chained hashes of its first full blocks (shared_prefix.py): its tokens only ever grow at
        # the end (prompt, then outputs), so a waiting prompt is hashed once, not at every step.
        self.block_hashes: list[int] = []
        self.admit_order = 0  # when it was last admitted: the newest is preempted first
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None  # set by the scheduler as it finishes
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.params.skip_special_tokens)
        self.stop_checker = StopStringChecker(self.params.stop_strings + self.params.markup_stop_strings)
        self.pipeline = request.make_pipeline() if request.make_pipeline is not None else None
        self.matcher = request.constraint.new_matcher() if request.constraint is not None else None
        # The key of its random draws (``sampler.seeded_uniform``): each choice of a seeded request its own.
        self.seed: int | None = None if self.params.seed is None else (self.params.seed + index) % 2**64

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.prefill_token_ids)

    @property
    def num_uncomputed_prompt_tokens(self) -> int:
        return self.num_prefill_tokens - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
