"""Where a sequence stands in the engine: its status, its slot, how much of it the KV cache holds.

The scheduler (``scheduler.py``) performs every change of ``status`` and ``slot``; the block
budgets (``kv_blocks.py``) count ``num_kv_blocks``. Kept apart from the sequence's text and
sampling state so that a reader of this class answers "who moves a sequence?" with one file.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum, auto


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


@dataclass(eq=False, slots=True)
class SchedulingState:
    """One sequence's place in the scheduler's queues and the KV cache."""

    # What prefill puts in the KV cache: the prompt, plus the tokens already sent when the
    # sequence resumes a job whose first worker died, or was preempted after producing some.
    prefill_token_ids: list[int]
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_kv_blocks: int = 0  # KV blocks held in its own slot (kv_blocks.py)
    admit_order: int = 0  # when it was last admitted: the newest is preempted first
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None  # set by the scheduler as it finishes

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.prefill_token_ids)

    @property
    def num_uncomputed_prompt_tokens(self) -> int:
        return self.num_prefill_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
