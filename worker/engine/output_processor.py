"""From a sampled token to a delta event: stop tokens, detokenization, stop strings, length
limits, parsing; each a named step of ``process``, which decides whether the choice ends and
why, and leaves ending it to the scheduler."""

from __future__ import annotations

from typing import NamedTuple

from shared.events import DeltaEvent, TokenLogprob
from worker.engine.scheduling_state import FinishReason
from worker.engine.sequence import Sequence
from worker.parsers.base import ParsedDelta


class TokenOutcome(NamedTuple):
    delta: DeltaEvent | None  # None: nothing to send yet (text held back, no logprob asked for)
    finish_reason: FinishReason | None  # the choice ends with this token


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None = None) -> TokenOutcome:
        """Append ``token_id`` to ``seq``; what to send, and whether the choice ends.

        Every delta carries the ids of the tokens generated since the previous one, so the job's
        event log holds all of them: another worker can resume the job from there.
        """
        self._append(seq, token_id)
        reason = self._stop_token_reason(seq, token_id)  # a stop token's own text is never shown
        text = "" if reason else self._visible_text(seq, token_id)
        reason = reason or self._limit_reason(seq)
        if reason and not seq.output.stop_checker.is_stopped:
            text += self._held_back_text(seq)
        if seq.output.stop_checker.is_stopped:
            reason = FinishReason.STOP
        parsed = self._parse(seq, text, is_last=reason is not None)
        if reason is FinishReason.STOP and seq.output.pipeline is not None and seq.output.pipeline.num_tool_calls:
            reason = FinishReason.TOOL_CALLS
        if parsed.is_empty and reason is None and logprob is None:
            return TokenOutcome(None, None)
        return TokenOutcome(self._delta(seq, token_id, parsed, reason, logprob), reason)

    @staticmethod
    def replay(seq: Sequence, token_ids: list[int]) -> None:
        """Feed tokens a previous worker already sent through this sequence's text pipeline, with
        no events: detokenizer, stop strings and parsers end up exactly where they were."""
        output = seq.output
        for token_id in token_ids:
            seq.output_token_ids.append(token_id)
            seq.request.num_completion_tokens += 1
            text = output.stop_checker.push(output.detokenizer.push(token_id))
            if output.pipeline is not None and text:
                output.pipeline.feed(text)

    # -- the steps of ``process`` -----------------------------------------------------------------
    @staticmethod
    def _append(seq: Sequence, token_id: int) -> None:
        seq.output_token_ids.append(token_id)
        seq.request.num_completion_tokens += 1
        seq.output.unsent_token_ids.append(token_id)

    def _stop_token_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """EOS or one of the request's stop token ids, once past ``min_tokens``."""
        params = seq.params
        if len(seq.output_token_ids) <= params.min_new_tokens:
            return None
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            return FinishReason.STOP
        return None

    @staticmethod
    def _visible_text(seq: Sequence, token_id: int) -> str:
        """The token's text as far as it can be shown: complete characters, short of any stop string."""
        return seq.output.stop_checker.push(seq.output.detokenizer.push(token_id))

    def _limit_reason(self, seq: Sequence) -> FinishReason | None:
        """A stop string just matched, max_tokens or the context is reached, or the grammar cannot go on."""
        if seq.output.stop_checker.is_stopped:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        if seq.sampling.matcher is not None and seq.sampling.matcher.is_error:
            return FinishReason.STOP  # logged by the sampler
        return None

    @staticmethod
    def _held_back_text(seq: Sequence) -> str:
        """At the end: the detokenizer's and the stop checker's held-back text (which may itself
        complete a stop string, cutting it there)."""
        text = seq.output.stop_checker.push(seq.output.detokenizer.flush())
        return text if seq.output.stop_checker.is_stopped else text + seq.output.stop_checker.flush()

    @staticmethod
    def _parse(seq: Sequence, text: str, is_last: bool) -> ParsedDelta:
        """Reasoning and tool calls split out of the text (when the request has a parser)."""
        if seq.output.pipeline is None:
            return ParsedDelta(content=text)
        parsed = seq.output.pipeline.feed(text) if text else ParsedDelta()
        return parsed.extend(seq.output.pipeline.finish()) if is_last else parsed

    def _delta(
        self,
        seq: Sequence,
        token_id: int,
        parsed: ParsedDelta,
        reason: FinishReason | None,
        logprob: TokenLogprob | None,
    ) -> DeltaEvent:
        token_ids, seq.output.unsent_token_ids = seq.output.unsent_token_ids, []
        return DeltaEvent(
            seq=seq.request.take_event_seq(),
            index=seq.index,
            token_ids=token_ids,
            content=parsed.content or None,
            reasoning=parsed.reasoning or None,
            tool_calls=parsed.tool_calls or None,
            logprobs=[logprob] if logprob is not None else None,
            finish_reason=reason.value if reason is not None else None,
            stop_reason=self._stop_reason(seq, token_id) if reason is FinishReason.STOP else None,
        )

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | int | None:
        """What ended a stopped choice, as vLLM reports it: the request's stop string or stop token
        id that matched; None for EOS (and for markup the tool-call plan stops on)."""
        matched = seq.output.stop_checker.matched
        if matched is not None:
            return matched if matched in seq.params.stop_strings else None
        if token_id in seq.params.stop_token_ids and token_id not in self.eos_token_ids:
            return token_id
        return None
