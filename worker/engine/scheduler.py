"""Iteration-level scheduling over KV slots: admit, chunk prefills, release and compact.

Every step decodes all sequences that hold a slot and spends the rest of the token budget on
prompt chunks, so a long prompt never stalls running streams for more than one chunk.
Sequences leave the batch the moment they finish; the last slot moves into the hole so the
running batch stays ``0..N-1``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from worker.engine.sequence import Sequence, SequenceStatus

SlotMover = Callable[[int, int, int], None]


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.seq.num_prefill_tokens


@dataclass
class ScheduledStep:
    running: list[Sequence]  # slot order: running[i].slot == i; all of them take part in decode
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    # The step only prefills: it completes an interactive prompt while batch lines decode, and
    # its first token should not wait for a decode of every batch row (they decode next step).
    skip_decode: bool = False

    @property
    def decoding(self) -> list[Sequence]:
        if self.skip_decode:
            return []
        return [seq for seq in self.running if seq.status is SequenceStatus.DECODING]

    @property
    def is_empty(self) -> bool:
        return not self.running


class Scheduler:
    def __init__(
        self,
        num_slots: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        move_slot: SlotMover,
        on_admit: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.max_running = min(num_slots, max_num_seqs)
        self.max_num_batched_tokens = max_num_batched_tokens
        # Decode can fill the whole budget at high concurrency; new prompts still get a share.
        self.min_prefill_tokens = max(1, max_num_batched_tokens // 4)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._move_slot = move_slot
        self._on_admit = on_admit

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Waiting sequences are admitted by priority (interactive before batch), FIFO within one."""
        position = len(self.waiting)
        while position and self.waiting[position - 1].request.priority > seq.request.priority:
            position -= 1
        self.waiting.insert(position, seq)

    def schedule(self) -> ScheduledStep:
        num_decoding = sum(seq.status is SequenceStatus.DECODING for seq in self.running)
        budget = max(self.max_num_batched_tokens - num_decoding, self.min_prefill_tokens)
        chunks: list[PrefillChunk] = []
        query_len = 0
        for seq in self._prefill_candidates():
            if seq.status is SequenceStatus.WAITING:
                if chunks and (len(chunks) + 1) * query_len > budget:
                    break
                self._admit(seq)  # may load a cached prefix, shortening what is left to compute
            length = min(seq.num_uncomputed_prompt_tokens, query_len or budget)
            # Rows are padded to the longest chunk, so the padded size is what the budget pays.
            if length < 1 or (len(chunks) + 1) * max(query_len, length) > budget:
                break
            chunks.append(PrefillChunk(seq, seq.num_computed_tokens, length))
            query_len = max(query_len, length)
        completes_interactive = any(chunk.completes_prompt and chunk.seq.request.priority == 0 for chunk in chunks)
        skip_decode = completes_interactive and any(seq.request.priority > 0 for seq in self.running)
        return ScheduledStep(list(self.running), chunks, skip_decode)

    def _prefill_candidates(self) -> Iterator[Sequence]:
        """Sequences holding a slot with prompt left, then waiting ones while slots are free; of
        those, only the most urgent priority's, so batch prompts never slow an interactive one's step."""
        prefilling = [seq for seq in self.running if seq.status is SequenceStatus.PREFILLING]
        can_admit = bool(self.waiting) and len(self.running) < self.max_running
        priorities = [seq.request.priority for seq in prefilling]
        if can_admit:
            priorities.append(self.waiting[0].request.priority)  # waiting is in priority order
        if not priorities:
            return
        urgent = min(priorities)
        yield from [seq for seq in prefilling if seq.request.priority == urgent]
        while self.waiting and len(self.running) < self.max_running and self.waiting[0].request.priority == urgent:
            yield self.waiting[0]

    def _admit(self, seq: Sequence) -> None:
        self.waiting.popleft()
        seq.slot = len(self.running)
        seq.status = SequenceStatus.PREFILLING
        self.running.append(seq)
        if self._on_admit is not None:
            self._on_admit(seq)

    def release(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out; the last slot fills its hole."""
        seq.status = SequenceStatus.FINISHED
        if seq.slot is None:
            if seq in self.waiting:
                self.waiting.remove(seq)
            return
        hole, last = seq.slot, self.running[-1]
        self.running.pop()
        seq.slot = None
        if last is not seq:
            self._move_slot(last.slot, hole, last.num_computed_tokens)  # type: ignore[arg-type]
            last.slot = hole
            self.running[hole] = last
