"""The engine loop: schedule, run, sample, postprocess, emit — on its own thread.

Jobs (on the asyncio side) ``submit`` requests and ``abort`` them; both only queue a command,
so the loop owns all state and needs no locks. Each step hands the events it produced to the
sink in one call, which lets the publisher send a whole step to Redis in one round trip.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shared.errors import ErrorKind
from shared.events import AnyEvent, EndEvent, ErrorEvent, TokenLogprob, UsageCounts
from worker.engine.detokenizer import Decoder
from worker.engine.drafter import Drafter
from worker.engine.held_prefixes import HeldPrefixes
from worker.engine.logprobs import exact_log_softmax, token_logprobs, torch_log_softmax
from worker.engine.model_runner import ModelRunner, prefix_of
from worker.engine.output_processor import OutputProcessor
from worker.engine.sampler import Sampler
from worker.engine.sampling_state import SlotSamplingState
from worker.engine.scheduler import ScheduledStep, Scheduler
from worker.engine.scheduling_state import FinishReason, SequenceStatus
from worker.engine.sequence import EngineRequest, Sequence

logger = logging.getLogger(__name__)

# How often the placement keys of ended jobs are checked against the prefix cache, at most.
_HELD_CHECK_S = 1.0


@dataclass
class RequestOutput:
    request_id: str
    events: list[AnyEvent]
    is_done: bool


OutputSink = Callable[[list[RequestOutput]], None]
# Placement keys this engine holds no more, each with the latest claim (ms) of a job that named it.
KeysReleased = Callable[[list[tuple[str, int]]], None]


class EngineLoad(NamedTuple):
    num_running: int
    num_waiting: int
    prefix_cache_hit_rate: float
    kv_cache_usage: float  # share of the KV budget's blocks held (0-1)


@dataclass(frozen=True)
class _Abort:
    request_id: str
    kind: ErrorKind | None
    message: str


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        sampling_state: SlotSamplingState,
        tokenizer: Decoder,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        sink: OutputSink,
        exact_sums: bool = False,
        drafter: Drafter | None = None,
    ) -> None:
        """``exact_sums``: the plan's exact numerics (the sampler sums in the kernels' fixed order);
        ``drafter``: where decoding sequences guess their next tokens (None: no speculation)."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampling_state = sampling_state
        self.sampler = Sampler(sampling_state, eos_token_ids, exact_sums=exact_sums)
        self._log_softmax = exact_log_softmax if exact_sums else torch_log_softmax
        self.scheduler = scheduler
        self.output_processor = OutputProcessor(eos_token_ids, max_model_len)
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.num_draft_tokens = 0  # drafted, and of those kept (verified equal to what was sampled)
        self.num_accepted_tokens = 0
        self._sink = sink
        self._requests: dict[str, EngineRequest] = {}
        self._outbox: dict[str, RequestOutput] = {}  # this step's events per request, in order
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_token)  # for logprobs
        self._inbox: queue.SimpleQueue[EngineRequest | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.before_step: Callable[[], None] | None = None  # run on the loop's thread before each step
        self.held = HeldPrefixes(scheduler.prefixes)
        self.on_keys_released: KeysReleased | None = None  # called on the loop's thread
        self._held_checked_at = 0.0

    # -- API for jobs (any thread) --------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        self._inbox.put(request)
        self._wake.set()

    def abort(self, request_id: str, kind: ErrorKind | None = None, message: str = "") -> None:
        """Stop a request submitted before this call; with ``kind`` its stream ends with that
        error, without it silently. A request that already ended is left alone, and so is one
        submitted later under the same id (the same job claimed again)."""
        self._inbox.put(_Abort(request_id, kind, message))
        self._wake.set()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def load(self) -> EngineLoad:
        """What the registry reports: running and waiting sequences, KV use, prefix-cache hits."""
        scheduler = self.scheduler
        hit_rate = scheduler.prefixes.stats.hit_rate
        return EngineLoad(scheduler.num_running, scheduler.num_waiting, hit_rate, scheduler.budget.usage)

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    def start(self) -> None:
        """Run the loop on a new thread (tests; a worker runs it on the thread that loaded the model)."""
        self._thread = threading.Thread(target=self.run_forever, name="relaylm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the loop -------------------------------------------------------------------------------
    def run_forever(self) -> None:
        """The engine loop; returns after ``stop``."""
        while not self._stopping.is_set():
            if self.before_step is not None:
                self.before_step()
            try:
                did_work = self.run_step()
            except Exception:
                logger.exception("engine step failed; failing every request in the engine")
                self._fail_all("generation failed inside the worker")
                continue
            self._report_released_keys()
            if not did_work:
                self._wake.wait(timeout=1.0)
                self._wake.clear()

    def run_step(self) -> bool:
        """Apply queued submissions and aborts, run one step, hand its events to the sink.

        Returns False when there was nothing to do."""
        self._drain_inbox()
        did_work = self.scheduler.has_work
        if did_work:
            self.step()
        self._flush()
        return did_work

    def _emit(self, request_id: str, event: AnyEvent | None = None, is_done: bool = False) -> None:
        output = self._outbox.setdefault(request_id, RequestOutput(request_id, [], False))
        if event is not None:
            output.events.append(event)
        output.is_done = output.is_done or is_done

    def _flush(self) -> None:
        if self._outbox:
            outputs, self._outbox = list(self._outbox.values()), {}
            self._sink(outputs)

    def step(self) -> None:
        scheduled = self.scheduler.schedule(self._draft if self.drafter is not None else None)
        self._follow_slots(scheduled)
        if scheduled.is_empty:
            return
        logits = self._run_model(scheduled)
        seqs = self.scheduler.complete_step(scheduled)
        for chunk in scheduled.prefill_chunks:
            if chunk.completes_prompt:
                self._remember_prefix(chunk.seq, finishing=False)
        if not seqs:
            return
        # Each sequence's first row, and the drafted chunks' rows (``_run_model``'s order).
        producing = [chunk for chunk in scheduled.prefill_chunks if chunk.draft or chunk.completes_prompt]
        first_rows = list(range(len(seqs) - len(producing)))
        drafted: list[tuple[Sequence, int, tuple[int, ...]]] = []
        row = len(first_rows)
        for chunk in producing:
            first_rows.append(row)
            if chunk.draft:
                drafted.append((chunk.seq, row, chunk.draft[1:]))
            row += chunk.num_logit_rows
        ended = self._sample(logits[first_rows] if drafted else logits, seqs)
        if drafted:
            ended += self._verify(logits, drafted, {id(seq) for seq, _ in ended})
        self._end_choices(ended)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[Sequence, FinishReason]]:
        """One token for each of ``seqs`` from its row of ``logits``, handed to the output;
        returns the choices that ended."""
        slots = torch.tensor([seq.sched.slot for seq in seqs], dtype=torch.long, device=logits.device)
        token_ids = self.sampler.sample(logits, slots, seqs).tolist()
        logprobs = token_logprobs(logits, token_ids, seqs, self._token_text, self._log_softmax)
        return self._postprocess(seqs, token_ids, logprobs)

    def _verify(
        self, logits: torch.Tensor, drafted: list[tuple[Sequence, int, tuple[int, ...]]], ended_ids: set[int]
    ) -> list[tuple[Sequence, FinishReason]]:
        """Drafted tokens, position by position: where the token just sampled equals the one
        drafted there, the next position's logits (computed with that token as input) are exactly
        what the next step would compute, so the next token is sampled from them, with the
        sampling state (grammar, penalties, the seeded draw of that position) already moved on by
        the token before. The first token sampled that differs from the draft, or that ends the
        choice, ends its verification: the text is what decoding one token a step gives."""
        num_accepted = dict.fromkeys((id(seq) for seq, _, _ in drafted), 0)
        ended: list[tuple[Sequence, FinishReason]] = []
        verifying = drafted
        for position in range(1, 1 + max(len(draft) for _, _, draft in drafted)):
            # Once a sequence sampled other than its draft, it is done for the step, even where a
            # later drafted token happens to equal its last one.
            verifying = [
                (seq, first_row, draft)
                for seq, first_row, draft in verifying
                if position <= len(draft) and id(seq) not in ended_ids and seq.last_token_id == draft[position - 1]
            ]
            if not verifying:
                break
            for seq, _, _ in verifying:
                self.scheduler.accept_draft_token(seq)
                num_accepted[id(seq)] += 1
            rows = [first_row + position for _, first_row, _ in verifying]
            now_ended = self._sample(logits[rows], [seq for seq, _, _ in verifying])
            ended_ids.update(id(seq) for seq, _ in now_ended)
            ended += now_ended
        for seq, _, draft in drafted:
            seq.draft.record(len(draft), num_accepted[id(seq)])
            self.num_draft_tokens += len(draft)
            self.num_accepted_tokens += num_accepted[id(seq)]
        return ended

    def _draft(self, seq: Sequence) -> list[int]:
        """What ``seq`` may guess this step: nothing past its last possible token, for a prompt
        with images (its positions are the model's own), or once it has finished."""
        assert self.drafter is not None
        if seq.request.images is not None:
            return []
        limit = min(seq.params.max_new_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
        if limit < 1:
            return []
        return self.drafter.propose(seq.prompt_token_ids + seq.output_token_ids, seq.draft, limit)

    def _follow_slots(self, scheduled: ScheduledStep) -> None:
        """The sampling state follows the scheduler's slots: moved sequences, then admitted ones."""
        for move in scheduled.slot_moves:
            self.sampling_state.move(move.src, move.dst)
        for seq in scheduled.admitted:
            assert seq.sched.slot is not None
            self.sampling_state.assign(seq.sched.slot, seq.params, seq.prompt_token_ids, seq.output_token_ids)

    def _run_model(self, scheduled: ScheduledStep) -> torch.Tensor:
        """Decode every running row (prefilling and drafting rows ride along as padding), then
        prefill and drafted chunks; the logits of the rows that produce a token, in
        ``Scheduler.complete_step``'s order, a drafted chunk's rows one after the other."""
        parts: list[torch.Tensor] = []
        decoding = scheduled.decoding
        if decoding:
            running = scheduled.running
            token_ids = [seq.last_token_id if seq.sched.status is SequenceStatus.DECODING else 0 for seq in running]
            positions = [seq.sched.num_computed_tokens for seq in running]
            deltas = [seq.request.images.rope_delta if seq.request.images is not None else 0 for seq in running]
            rope_deltas = deltas if any(deltas) else None
            adapters = [seq.request.adapter for seq in running]
            logits = self.runner.decode(
                token_ids, positions, [prefix_of(seq) for seq in running], rope_deltas,
                adapters if any(adapters) else None,
            )  # fmt: skip
            if len(decoding) < len(running):
                logits = logits[[seq.sched.slot for seq in decoding]]
            parts.append(logits)
        if scheduled.prefill_chunks:
            chunks = scheduled.prefill_chunks
            logits = self.runner.prefill(chunks)
            rows: list[int] = []
            row = 0
            for chunk in chunks:
                if chunk.draft or chunk.completes_prompt:
                    rows.extend(range(row, row + chunk.num_logit_rows))
                row += chunk.num_logit_rows
            parts.append(logits[rows])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _postprocess(
        self, seqs: list[Sequence], token_ids: list[int], logprobs: list[TokenLogprob | None]
    ) -> list[tuple[Sequence, FinishReason]]:
        """Each token to its choice's output; returns the choices it ended (``_end_choices``)."""
        ended = []
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs, strict=True):
            delta, finish_reason = self.output_processor.process(seq, token_id, logprob)
            if delta is None:
                continue
            self._emit(seq.request.request_id, delta)
            if finish_reason is not None:
                ended.append((seq, finish_reason))
        return ended

    def _end_choices(self, ended: list[tuple[Sequence, FinishReason]]) -> None:
        """Choices that ended this step leave the batch, once every token of the step is sampled:
        a slot freed earlier would move another sequence, and its sampling state, mid-step."""
        for seq, finish_reason in ended:
            request = seq.request
            self._remember_prefix(seq, finishing=True)
            self.scheduler.finish(seq, finish_reason)
            request.num_finished += 1
            if request.is_finished:
                self._emit(request.request_id, self._end_event(request), is_done=True)
                if self._requests.get(request.request_id) is request:
                    self._forget(request)

    @staticmethod
    def _end_event(request: EngineRequest) -> EndEvent:
        usage = UsageCounts(
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_completion_tokens,
            cached_tokens=request.num_cached_tokens,
        )
        return EndEvent(seq=request.take_event_seq(), usage=usage)

    # -- commands -------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, EngineRequest):
                self._add_request(command)
            else:
                self._abort_request(command)

    def _add_request(self, request: EngineRequest) -> None:
        earlier = self._requests.get(request.request_id)
        if earlier is not None:
            # The same job claimed again while its earlier attempt runs here (during a Redis
            # failover a demoted primary can still answer a claim): the new attempt is the one
            # its runner follows, so the earlier one stops, silently, and nothing else is touched.
            logger.warning("request %s arrived again while it runs; its earlier attempt stops", request.request_id)
            self._release(earlier)
            self._forget(earlier)
        self._requests[request.request_id] = request
        self.held.started(request)
        if request.start_event is not None:
            self._emit(request.request_id, request.start_event)
        if request.images is not None and not self._encode_images(request):
            return
        resume = request.resume
        if resume is not None:
            request.next_event_seq = resume.next_event_seq
        for prompt_index, prompt in enumerate(request.prompts):
            for choice in range(request.num_choices):
                seq = Sequence(request, prompt_index * request.num_choices + choice, prompt, self.tokenizer)
                request.sequences.append(seq)
                if resume is not None and seq.index in resume.finished_choices:
                    self.scheduler.add_finished(seq)
                    request.num_finished += 1
                    continue
                if resume is not None:
                    self._resume_sequence(seq, resume.output_token_ids.get(seq.index, []))
                self.scheduler.add(seq)
        if request.is_finished:  # every choice had finished; only the end event was missing
            self._emit(request.request_id, self._end_event(request), is_done=True)
            self._forget(request)

    def _encode_images(self, request: EngineRequest) -> bool:
        """The request's image embeddings, on this thread (the vision tower is torch work too);
        an image the tower cannot take fails its request, not the loop."""
        assert request.images is not None
        try:
            request.images.ensure_encoded()
        except Exception:
            logger.exception("request %s: encoding its images failed", request.request_id)
            self._abort_request(_Abort(request.request_id, ErrorKind.INTERNAL, "encoding the request's images failed"))
            return False
        return True

    def _resume_sequence(self, seq: Sequence, sent_token_ids: list[int]) -> None:
        """Rebuild the text pipeline from the tokens already sent and prefill them after the
        prompt, so the rest continues as if nothing had happened (a seeded draw depends on its
        position alone, so nothing else needs to catch up)."""
        self.output_processor.replay(seq, sent_token_ids)
        self.sampler.replay(seq, sent_token_ids)
        seq.sched.prefill_token_ids = seq.prompt_token_ids + sent_token_ids

    def _abort_request(self, command: _Abort) -> None:
        request = self._requests.get(command.request_id)
        if request is None:
            return  # it already ended: an abort names the request submitted before it, if any
        self._release(request)
        self._forget(request)
        error = None
        if command.kind is not None:
            error = ErrorEvent(seq=request.take_event_seq(), kind=command.kind, message=command.message)
        self._emit(request.request_id, error, is_done=True)

    def _release(self, request: EngineRequest) -> None:
        for seq in request.sequences:
            if not seq.sched.is_finished:
                self.scheduler.release(seq)

    def _forget(self, request: EngineRequest) -> None:
        """``request`` leaves the engine: its placement keys stay held while its prompt is cached."""
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        self.held.ended(request)

    def _report_released_keys(self) -> None:
        now = time.monotonic()
        if now - self._held_checked_at < _HELD_CHECK_S:
            return
        self._held_checked_at = now
        released = self.held.released()
        if released and self.on_keys_released is not None:
            self.on_keys_released(released)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._requests):
            self._abort_request(_Abort(request_id, ErrorKind.INTERNAL, message))
        self._flush()

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- prefix cache -----------------------------------------------------------------------------
    def _remember_prefix(self, seq: Sequence, finishing: bool) -> None:
        """Offer a sequence's computed blocks to the prefix cache (prompt done, or finished)."""
        if seq.sched.slot is None:
            return
        tokens = seq.prompt_token_ids + seq.output_token_ids
        self.scheduler.prefixes.remember(seq, tokens, seq.sched.num_computed_tokens, finishing)
