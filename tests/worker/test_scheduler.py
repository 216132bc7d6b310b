"""Admission, chunked prefill within the token budget, release and slot compaction."""

from __future__ import annotations

from tests.worker.engine_helpers import make_seq
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler, SlotMove
from worker.engine.scheduling_state import SequenceStatus
from worker.engine.sequence import Sequence


def _scheduler(num_slots: int = 4, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(num_slots, max_num_seqs, budget)


def _seq(prompt_len: int, name: str = "r") -> Sequence:
    return make_seq(SamplingParams(), prompt=list(range(prompt_len)), request_id=name)


def _finish_prefill(scheduler: Scheduler) -> None:
    for chunk in scheduler.schedule().prefill_chunks:
        chunk.seq.sched.num_computed_tokens += chunk.length
        if chunk.completes_prompt:
            chunk.seq.sched.status = SequenceStatus.DECODING


def test_admission_stops_at_the_slot_count() -> None:
    scheduler = _scheduler(num_slots=2, budget=1000)
    for i in range(3):
        scheduler.add(_seq(4, f"r{i}"))
    step = scheduler.schedule()
    assert [chunk.seq.request.request_id for chunk in step.prefill_chunks] == ["r0", "r1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1


def test_max_num_seqs_caps_admission_below_the_slot_count() -> None:
    scheduler = _scheduler(num_slots=8, max_num_seqs=1, budget=1000)
    scheduler.add(_seq(4, "a"))
    scheduler.add(_seq(4, "b"))
    scheduler.schedule()
    assert scheduler.num_running == 1


def test_a_long_prompt_is_chunked_by_the_budget() -> None:
    scheduler = _scheduler(budget=32)
    seq = _seq(100)
    scheduler.add(seq)
    lengths = []
    while seq.sched.status is not SequenceStatus.DECODING:
        step = scheduler.schedule()
        lengths.append(step.prefill_chunks[0].length)
        _finish_prefill_step(step)
    assert lengths == [32, 32, 32, 4]


def _finish_prefill_step(step: object) -> None:
    for chunk in step.prefill_chunks:  # type: ignore[attr-defined]
        chunk.seq.sched.num_computed_tokens += chunk.length
        if chunk.completes_prompt:
            chunk.seq.sched.status = SequenceStatus.DECODING


def test_padded_rows_count_against_the_budget() -> None:
    scheduler = _scheduler(budget=16)
    scheduler.add(_seq(10, "a"))
    scheduler.add(_seq(10, "b"))
    assert len(scheduler.schedule().prefill_chunks) == 1  # two rows of 10 would cost 20 > 16


def test_decode_rows_leave_prompts_a_share_of_the_budget() -> None:
    scheduler = _scheduler(num_slots=8, budget=8)
    for i in range(7):
        scheduler.add(_seq(1, f"d{i}"))
    for _ in range(7):
        _finish_prefill(scheduler)
    assert sum(seq.sched.status is SequenceStatus.DECODING for seq in scheduler.running) == 7
    scheduler.add(_seq(50, "new"))
    step = scheduler.schedule()
    assert step.prefill_chunks and step.prefill_chunks[0].length == 2  # budget // 4


def test_release_moves_the_last_slot_into_the_hole() -> None:
    scheduler = _scheduler(budget=1000)
    seqs = [_seq(3, f"r{i}") for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    _finish_prefill(scheduler)
    scheduler.release(seqs[0])
    assert scheduler.schedule().slot_moves == [SlotMove(src=2, dst=0)]  # reported at the next step
    assert [seq.sched.slot for seq in scheduler.running] == [0, 1]
    assert scheduler.running == [seqs[2], seqs[1]]
    assert seqs[0].sched.status is SequenceStatus.FINISHED and seqs[0].sched.slot is None


def test_releasing_a_waiting_sequence_just_drops_it() -> None:
    scheduler = _scheduler(num_slots=1, budget=1000)
    first, second = _seq(3, "a"), _seq(3, "b")
    scheduler.add(first)
    scheduler.add(second)
    scheduler.schedule()
    scheduler.release(second)
    assert scheduler.num_waiting == 0 and scheduler.schedule().slot_moves == []


def test_waiting_interactive_requests_are_admitted_before_waiting_batch_lines() -> None:
    scheduler = _scheduler(num_slots=2, budget=1000)
    for name, priority in [("batch0", 1), ("batch1", 1), ("chat0", 0), ("batch2", 1), ("chat1", 0)]:
        seq = _seq(4, name)
        seq.request.priority = priority
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [chunk.seq.request.request_id for chunk in first.prefill_chunks] == ["chat0", "chat1"]
    assert [seq.request.request_id for seq in scheduler.waiting] == ["batch0", "batch1", "batch2"]


def test_a_step_that_prefills_an_interactive_prompt_leaves_batch_prompts_for_later() -> None:
    scheduler = _scheduler(num_slots=4, budget=1000)
    batch_seq = _seq(40, "batch")
    batch_seq.request.priority = 1
    scheduler.add(batch_seq)
    scheduler.schedule()  # the batch line is admitted and starts its prompt
    chat = _seq(8, "chat")
    scheduler.add(chat)
    step = scheduler.schedule()
    assert [chunk.seq.request.request_id for chunk in step.prefill_chunks] == ["chat"]
    assert batch_seq in step.running  # still holds its slot; its prompt continues next step


def test_completing_an_interactive_prompt_beside_batch_rows_is_a_prefill_only_step() -> None:
    scheduler = _scheduler(num_slots=4, budget=1000)
    batch_seq = _seq(4, "batch")
    batch_seq.request.priority = 1
    scheduler.add(batch_seq)
    _finish_prefill(scheduler)
    assert batch_seq.sched.status is SequenceStatus.DECODING
    scheduler.add(_seq(4, "chat"))
    step = scheduler.schedule()
    assert step.skip_decode and step.decoding == [] and len(step.prefill_chunks) == 1
    _finish_prefill_step(step)
    assert scheduler.schedule().decoding == [batch_seq, *[s for s in scheduler.running if s is not batch_seq]]


def test_a_quiet_keys_prompt_is_admitted_first_and_completes_in_a_prefill_only_step() -> None:
    scheduler = _scheduler(num_slots=4, budget=1000)
    flood = _seq(4, "flood")
    scheduler.add(flood)
    _finish_prefill(scheduler)
    scheduler.add(_seq(4, "chat"))
    quiet = _seq(4, "quiet")
    quiet.request.priority = -1  # in a slot kept for quiet API keys
    scheduler.add(quiet)
    assert [seq.request.request_id for seq in scheduler.waiting] == ["quiet", "chat"]
    step = scheduler.schedule()
    assert [chunk.seq.request.request_id for chunk in step.prefill_chunks] == ["quiet"]
    assert step.skip_decode and step.decoding == []


def test_interactive_only_steps_still_decode_beside_a_new_prompt() -> None:
    scheduler = _scheduler(num_slots=4, budget=1000)
    scheduler.add(_seq(4, "first"))
    _finish_prefill(scheduler)
    scheduler.add(_seq(4, "second"))
    step = scheduler.schedule()
    assert not step.skip_decode and [seq.request.request_id for seq in step.decoding] == ["first"]
