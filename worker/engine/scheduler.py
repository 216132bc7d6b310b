"""Iteration-level scheduling over KV slots: admit, chunk prefills, preempt, release and compact.

Every step decodes all sequences that hold a slot and spends the rest of the token budget on
prompt chunks, so a long prompt never stalls running streams for more than one chunk.
Sequences leave the batch the moment they finish; the last slot moves into the hole so the
running batch stays ``0..N-1``.

Admission counts KV blocks (``kv_blocks.py``), not slots: a sequence is admitted when blocks
for its whole prompt are free, and grows a block at a time as it decodes. When a step's growth
does not fit, the least urgent sequence (batch before interactive, then the newest) is
preempted: its blocks are freed and it waits at the head of its priority to be recomputed
(prompt plus the tokens it already produced) and go on where it stopped.

Prompt prefixes computed before go through one interface (``prefixes.py``): with shared
prefixes a sequence attaches at admission to the longest cached chain its prompt begins with and
is charged blocks only for its own tokens after it (the prefix once, whoever reads it); with the
copying prefix cache, its cached blocks are copied into its slot at admission.

The scheduler owns every state change of a sequence (waiting → prefilling → decoding →
finished, and back to waiting when preempted; its ``sched`` state, ``scheduling_state.py``) and
the KV cache's slots. It calls nothing of the
engine's: what the engine keeps per slot follows from what ``schedule`` reports (the slot moves
since the last step, the sequences admitted in this one), and ``complete_step`` is told what the
model computed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from worker.engine.kv_blocks import KVBlockBudget
from worker.engine.prefixes import NoPrefixes, Prefixes
from worker.engine.scheduling_state import FinishReason, SequenceStatus
from worker.engine.sequence import Sequence
from worker.native.kv_cache import SlotKVCache


class SlotMove(NamedTuple):
    """The sequence in slot ``src`` now runs in slot ``dst`` (compaction after one left)."""

    src: int
    dst: int


logger = logging.getLogger(__name__)

MAX_DRAFTING = 4


@dataclass(frozen=True)
class PrefillChunk:
    """``length`` tokens of ``seq`` computed into its slot from position ``start``: prompt
    tokens, or, with ``draft``, the sequence's last token and the tokens drafted after it (their
    KV is kept only as far as the engine accepts them)."""

    seq: Sequence
    start: int
    length: int
    draft: tuple[int, ...] = ()

    @property
    def completes_prompt(self) -> bool:
        return not self.draft and self.start + self.length == self.seq.sched.num_prefill_tokens

    @property
    def token_ids(self) -> list[int]:
        if self.draft:
            return list(self.draft)
        return self.seq.sched.prefill_token_ids[self.start : self.start + self.length]

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits the step returns for the chunk: every drafted position's, else the last token's."""
        return self.length if self.draft else 1


# Tokens a sequence may draft, given the number it may still produce (the engine decides).
DraftSource = Callable[[Sequence], list[int]]


@dataclass
class ScheduledStep:
    running: list[Sequence]  # slot order: running[i].sched.slot == i; all of them take part in decode
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    # The step only prefills: it completes a prompt while less urgent rows decode (an interactive
    # prompt beside batch lines, a quiet key's beside another key's flood), and its first token
    # should not wait for a decode of every one of those rows (they decode next step).
    skip_decode: bool = False
    # Since the last step, in order: slots whose sequence moved (their KV already has), then the
    # sequences admitted to a slot. Per-slot state kept elsewhere (sampling) follows them.
    slot_moves: list[SlotMove] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def decoding(self) -> list[Sequence]:
        """The rows of the decode forward that produce a token (a drafting row's comes from its chunk)."""
        if self.skip_decode:
            return []
        drafting = {id(chunk.seq) for chunk in self.prefill_chunks if chunk.draft}
        return [seq for seq in self.running if seq.sched.status is SequenceStatus.DECODING and id(seq) not in drafting]

    @property
    def is_empty(self) -> bool:
        return not self.running


class Scheduler:
    def __init__(
        self,
        num_slots: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        budget: KVBlockBudget | None = None,
        memory: SlotKVCache | None = None,
        prefixes: Prefixes | None = None,
    ) -> None:
        """``memory``: the KV cache whose slots the sequences run in (None: slot order alone, for
        tests); ``prefixes``: the plan's prefix policy (none by default)."""
        self.max_running = min(num_slots, max_num_seqs)
        self.max_num_batched_tokens = max_num_batched_tokens
        # Decode can fill the whole budget at high concurrency; new prompts still get a share.
        self.min_prefill_tokens = max(1, max_num_batched_tokens // 4)
        # Decoding sequences that may draft in one step: past it, a step's rows keep the cores busy
        # and drafts would only add rows (``drafter.py``).
        self.max_drafting = MAX_DRAFTING
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._slot_moves: list[SlotMove] = []
        self._admitted: list[Sequence] = []
        # Without a budget (tests of slot order alone) every slot may hold a whole sequence.
        self.budget = budget or KVBlockBudget(2**62, 1)
        self._memory = memory
        self.prefixes: Prefixes = prefixes or NoPrefixes()
        self._num_admitted = 0
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_finished(self, seq: Sequence) -> None:
        """A choice an earlier attempt of its job already finished: it never runs here."""
        seq.sched.status = SequenceStatus.FINISHED

    def add(self, seq: Sequence) -> None:
        """Waiting sequences are admitted by priority (interactive before batch), FIFO within one."""
        position = len(self.waiting)
        while position and self.waiting[position - 1].request.priority > seq.request.priority:
            position -= 1
        self.waiting.insert(position, seq)

    def schedule(self, draft: DraftSource | None = None) -> ScheduledStep:
        """The next step. ``draft``: where decoding sequences may guess their next tokens (in
        steps without prompt chunks, up to ``max_drafting`` decoding sequences)."""
        self._make_room_to_decode()
        num_decoding = sum(seq.sched.status is SequenceStatus.DECODING for seq in self.running)
        budget = max(self.max_num_batched_tokens - num_decoding, self.min_prefill_tokens)
        chunks: list[PrefillChunk] = []
        query_len = 0
        for seq in self._prefill_candidates():
            if seq.sched.status is SequenceStatus.WAITING:
                if chunks and (len(chunks) + 1) * query_len > budget:
                    break
                if not self.prefixes.reserve(seq, self.budget):
                    break  # in order: a long prompt is not overtaken by every short one after it
                self._admit(seq)  # may load a cached prefix, shortening what is left to compute
            length = min(seq.sched.num_uncomputed_prompt_tokens, query_len or budget)
            # Rows are padded to the longest chunk, so the padded size is what the budget pays.
            if length < 1 or (len(chunks) + 1) * max(query_len, length) > budget:
                break
            chunks.append(PrefillChunk(seq, seq.sched.num_computed_tokens, length))
            query_len = max(query_len, length)
        if draft is not None and not chunks:
            chunks = self._draft_chunks(draft)
        completing = [chunk.seq.request.priority for chunk in chunks if chunk.completes_prompt]
        urgent = min(completing, default=None)
        skip_decode = urgent is not None and any(seq.request.priority > urgent for seq in self.running)
        self.prefixes.balance(self.running)
        if self._memory is not None:
            self._memory.trim(self.budget.num_blocks + self.prefixes.idle_blocks)
        moves, self._slot_moves = self._slot_moves, []
        admitted, self._admitted = self._admitted, []
        return ScheduledStep(list(self.running), chunks, skip_decode, moves, admitted)

    def complete_step(self, step: ScheduledStep) -> list[Sequence]:
        """The model computed ``step``: its decoding rows one token further, its chunks' prompt
        tokens in the cache. Returns the sequences that produce a token now, in the order of the
        step's logits: the decoding rows, then, in chunk order, those whose prompt this step
        completed and those that drafted (one token further, as a decoding row: each drafted
        token they keep is counted by ``accept_draft_token``)."""
        decoding = step.decoding
        for seq in decoding:
            seq.sched.num_computed_tokens += 1
        completed = []
        for chunk in step.prefill_chunks:
            if chunk.draft:
                chunk.seq.sched.num_computed_tokens += 1
                completed.append(chunk.seq)
                continue
            chunk.seq.sched.num_computed_tokens += chunk.length
            if chunk.completes_prompt:
                chunk.seq.sched.status = SequenceStatus.DECODING
                completed.append(chunk.seq)
        return decoding + completed

    def accept_draft_token(self, seq: Sequence) -> None:
        """The engine keeps the next drafted token of ``seq``: its KV, computed this step, counts.
        The KV of the drafted tokens not kept stays where it is, past the computed tokens: never
        read, and overwritten as the sequence grows into those positions."""
        seq.sched.num_computed_tokens += 1

    def _draft_chunks(self, draft: DraftSource) -> list[PrefillChunk]:
        """A chunk per decoding sequence that drafts (its last token, then the drafted ones),
        where the KV budget has the blocks outside its admission reserve; no preemption for a guess."""
        decoding = [seq for seq in self.running if seq.sched.status is SequenceStatus.DECODING]
        if not decoding or len(decoding) > self.max_drafting:
            return []
        chunks: list[PrefillChunk] = []
        for seq in decoding:
            tokens = draft(seq)
            if not tokens:
                continue
            start = seq.sched.num_computed_tokens
            length = 1 + len(tokens)
            if (len(chunks) + 1) * max([length, *(chunk.length for chunk in chunks)]) > self.max_num_batched_tokens:
                break
            extra = self.budget.extra_blocks(seq.sched, start + length - seq.prefix.shared_len)
            if extra and not self.budget.can_take(extra):
                continue
            self._grow(seq, start + length)
            chunks.append(PrefillChunk(seq, start, length, (seq.last_token_id, *tokens)))
        return chunks

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """``seq`` produced its last token; it leaves the batch."""
        seq.sched.finish_reason = reason
        self.release(seq)

    def _make_room_to_decode(self) -> None:
        """Every decoding sequence gets the block its next token needs; where they do not all
        fit, the least urgent sequences are preempted until they do."""
        while True:
            decoding = [seq for seq in self.running if seq.sched.status is SequenceStatus.DECODING]
            wanted = sum(
                self.budget.extra_blocks(seq.sched, seq.sched.num_computed_tokens + 1 - seq.prefix.shared_len)
                for seq in decoding
            )
            if wanted <= self.budget.num_free:
                break
            self.preempt(max(self.running, key=lambda seq: (seq.request.priority, seq.sched.admit_order)))
        for seq in decoding:
            self._grow(seq, seq.sched.num_computed_tokens + 1)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        """Let ``seq`` hold its first ``num_tokens`` tokens (those past its shared prefix in its slot)."""
        self.budget.grow(seq.sched, num_tokens - seq.prefix.shared_len)
        if self._memory is not None and seq.sched.slot is not None:
            self._memory.hold(seq.sched.slot, seq.sched.num_kv_blocks, seq.prefix.shared_len)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s slot and blocks; it waits at the head of its priority to be recomputed."""
        self._leave(seq)
        seq.sched.status = SequenceStatus.WAITING
        seq.sched.prefill_token_ids = seq.prompt_token_ids + seq.output_token_ids
        seq.sched.num_computed_tokens = 0
        seq.sched.num_preemptions += 1
        self.num_preemptions += 1
        logger.info(
            "preempted request_id=%s (KV budget: %d of %d blocks free); it will be recomputed from %d tokens",
            seq.request.request_id, self.budget.num_free, self.budget.num_blocks, seq.sched.num_prefill_tokens,
        )  # fmt: skip
        position = 0
        while position < len(self.waiting) and self.waiting[position].request.priority < seq.request.priority:
            position += 1
        self.waiting.insert(position, seq)

    def _prefill_candidates(self) -> Iterator[Sequence]:
        """Sequences holding a slot with prompt left, then waiting ones while slots are free; of
        those, only the most urgent priority's, so batch prompts never slow an interactive one's step."""
        prefilling = [seq for seq in self.running if seq.sched.status is SequenceStatus.PREFILLING]
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
        seq.sched.slot = len(self.running)
        seq.sched.status = SequenceStatus.PREFILLING
        seq.sched.admit_order = self._num_admitted
        self._num_admitted += 1
        self.running.append(seq)
        seq.sched.num_computed_tokens = seq.prefix.shared_len
        self._grow(seq, seq.sched.num_prefill_tokens + 1)  # the whole prompt, and the first token
        num_cached = seq.sched.num_computed_tokens = self.prefixes.fill(seq, seq.sched.slot)
        if not seq.sched.num_preemptions:  # usage reports the prompt's cached tokens, once
            seq.sched.num_cached_tokens = num_cached
        self._admitted.append(seq)

    def release(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out; the last slot fills its hole."""
        seq.sched.status = SequenceStatus.FINISHED
        if seq.sched.slot is None:
            if seq in self.waiting:
                self.waiting.remove(seq)
            return
        self._leave(seq)

    def _leave(self, seq: Sequence) -> None:
        """Out of the running batch: its blocks are freed, the last slot moves into its hole,
        and the slot left empty at the end is vacated (its memory goes back when trimmed)."""
        hole, last = seq.sched.slot, self.running[-1]
        assert hole is not None
        self.budget.free(seq.sched)
        self._admitted = [admitted for admitted in self._admitted if admitted is not seq]  # not yet reported
        self.prefixes.leave(seq)
        self.running.pop()
        seq.sched.slot = None
        if last is not seq:
            assert last.sched.slot is not None
            if self._memory is not None:
                self._memory.move_slot(last.sched.slot, hole, last.sched.num_computed_tokens)
            self._slot_moves.append(SlotMove(last.sched.slot, hole))
            last.sched.slot = hole
            self.running[hole] = last
        if self._memory is not None:
            self._memory.vacate(len(self.running))
