"""What turns one sequence's tokens into the text of its events: the detokenizer, the stop-string
checker, the reasoning / tool-call parsers, and the tokens not yet sent. Only the output
processor (``output_processor.py``) feeds and reads them; each holds text a later token may
complete, so they live as long as the sequence.
"""

from __future__ import annotations

from collections.abc import Callable

from worker.engine.detokenizer import Decoder, IncrementalDetokenizer
from worker.engine.sampling_params import SamplingParams
from worker.engine.stop_checker import StopStringChecker
from worker.parsers.pipeline import TextPipeline


class OutputState:
    __slots__ = ("detokenizer", "pipeline", "stop_checker", "unsent_token_ids")

    def __init__(
        self, params: SamplingParams, tokenizer: Decoder, make_pipeline: Callable[[], TextPipeline] | None
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        included = frozenset(params.stop_strings) if params.include_stop_str_in_output else frozenset()
        self.stop_checker = StopStringChecker(params.stop_strings + params.markup_stop_strings, included)
        self.pipeline = make_pipeline() if make_pipeline is not None else None
        self.unsent_token_ids: list[int] = []  # generated since the last delta event
