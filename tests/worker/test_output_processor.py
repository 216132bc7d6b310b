"""What ended a choice: the request's stop string or stop token id is reported (vLLM's
``stop_reason``); end-of-sequence and the tool-call plan's own stop markup are not."""

from __future__ import annotations

from shared.events import DeltaEvent
from tests.worker.engine_helpers import make_seq
from worker.engine.output_processor import OutputProcessor
from worker.engine.sampling_params import SamplingParams

EOS = 25  # decodes to "z" with the helpers' CharDecoder (id i → chr(97 + i % 26))


def _last_delta(params: SamplingParams, token_ids: list[int]) -> DeltaEvent:
    seq = make_seq(params)
    processor = OutputProcessor(eos_token_ids=frozenset({EOS}), max_model_len=1024)
    deltas = [delta for token in token_ids if (delta := processor.process(seq, token).delta) is not None]
    assert deltas and deltas[-1].finish_reason is not None, "the choice did not end"
    return deltas[-1]


def test_a_matched_stop_string_is_the_stop_reason() -> None:
    last = _last_delta(SamplingParams(max_new_tokens=50, stop_strings=("xyz", "cd")), [0, 1, 2, 3, 4])
    assert (last.finish_reason, last.stop_reason) == ("stop", "cd")


def test_a_stop_token_id_is_the_stop_reason() -> None:
    last = _last_delta(SamplingParams(max_new_tokens=50, stop_token_ids=frozenset({7})), [0, 7])
    assert (last.finish_reason, last.stop_reason) == ("stop", 7)


def test_end_of_sequence_and_length_have_none() -> None:
    assert _last_delta(SamplingParams(max_new_tokens=50, stop_strings=("q",)), [0, EOS]).stop_reason is None
    by_length = _last_delta(SamplingParams(max_new_tokens=2, stop_strings=("q",)), [0, 1])
    assert (by_length.finish_reason, by_length.stop_reason) == ("length", None)


def test_the_tool_plans_markup_stop_is_not_reported() -> None:
    params = SamplingParams(max_new_tokens=50, stop_strings=("q",), markup_stop_strings=("cd",))
    last = _last_delta(params, [0, 1, 2, 3])
    assert (last.finish_reason, last.stop_reason) == ("stop", None)
