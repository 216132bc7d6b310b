"""From a sampled token to a delta event: stop tokens, detokenization, stop strings, length limits."""

from __future__ import annotations

from shared.events import DeltaEvent, TokenLogprob
from worker.engine.sequence import Sequence
from worker.parsers.base import ParsedDelta


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None = None) -> DeltaEvent | None:
        """Append ``token_id`` to ``seq``; return the delta to send (None when nothing is visible yet).

        Every delta carries the ids of the tokens generated since the previous one, so the job's
        event log holds all of them: another worker can resume the job from there.
        """
        seq.output_token_ids.append(token_id)
        seq.request.num_completion_tokens += 1
        seq.unsent_token_ids.append(token_id)
        finish_reason = self._stop_token_reason(seq, token_id)
        text = "" if finish_reason else seq.stop_checker.push(seq.detokenizer.push(token_id))
        if seq.stop_checker.is_stopped:
            finish_reason = "stop"
        elif finish_reason is None and self._is_at_length_limit(seq):
            finish_reason = "length"
        elif finish_reason is None and seq.matcher is not None and seq.matcher.is_error:
            finish_reason = "stop"  # a grammar that cannot go on ends the choice (logged by the sampler)
        if finish_reason and not seq.stop_checker.is_stopped:
            text += seq.stop_checker.push(seq.detokenizer.flush())
            if seq.stop_checker.is_stopped:
                finish_reason = "stop"
            else:
                text += seq.stop_checker.flush()
        parsed = self._parse(seq, text, is_last=finish_reason is not None)
        if finish_reason == "stop" and seq.pipeline is not None and seq.pipeline.num_tool_calls:
            finish_reason = "tool_calls"
        seq.finish_reason = finish_reason
        stop_reason = self._stop_reason(seq, token_id) if finish_reason == "stop" else None
        if parsed.is_empty and finish_reason is None and logprob is None:
            return None
        token_ids, seq.unsent_token_ids = seq.unsent_token_ids, []
        return DeltaEvent(
            seq=seq.request.take_event_seq(),
            index=seq.index,
            token_ids=token_ids,
            content=parsed.content or None,
            reasoning=parsed.reasoning or None,
            tool_calls=parsed.tool_calls or None,
            logprobs=[logprob] if logprob is not None else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )

    @staticmethod
    def replay(seq: Sequence, token_ids: list[int]) -> None:
        """Feed tokens a previous worker already sent through this sequence's text pipeline, with
        no events: detokenizer, stop strings and parsers end up exactly where they were."""
        for token_id in token_ids:
            seq.output_token_ids.append(token_id)
            seq.request.num_completion_tokens += 1
            text = seq.stop_checker.push(seq.detokenizer.push(token_id))
            if seq.pipeline is not None and text:
                seq.pipeline.feed(text)
            if seq.matcher is not None:
                seq.matcher.accept_token(token_id)

    @staticmethod
    def _parse(seq: Sequence, text: str, is_last: bool) -> ParsedDelta:
        if seq.pipeline is None:
            return ParsedDelta(content=text)
        parsed = seq.pipeline.feed(text) if text else ParsedDelta()
        return parsed.extend(seq.pipeline.finish()) if is_last else parsed

    def _stop_token_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if len(seq.output_token_ids) <= params.min_new_tokens:
            return None
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        return None

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | int | None:
        """What ended a stopped choice, as vLLM reports it: the request's stop string or stop token
        id that matched; None for EOS (and for markup the tool-call plan stops on)."""
        matched = seq.stop_checker.matched
        if matched is not None:
            return matched if matched in seq.params.stop_strings else None
        if token_id in seq.params.stop_token_ids and token_id not in self.eos_token_ids:
            return token_id
        return None

    def _is_at_length_limit(self, seq: Sequence) -> bool:
        return len(seq.output_token_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.max_model_len
