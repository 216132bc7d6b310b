"""Small builders for engine unit tests."""

from __future__ import annotations

from worker.engine.prefix_state import PrefixLink, PrefixSlot
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduling_state import SchedulingState
from worker.engine.sequence import EngineRequest, Sequence
from worker.native.lora import LoraModel


class CharDecoder:
    """A stand-in tokenizer for tests that never look at text: token id ``i`` decodes to chr(97 + i % 26)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + token_id % 26) for token_id in token_ids)


def make_seq(params: SamplingParams | None = None, prompt: list[int] | None = None, request_id: str = "r") -> Sequence:
    request = EngineRequest(request_id, [prompt or [1, 2, 3]], params or SamplingParams())
    seq = Sequence(request, 0, request.prompts[0], CharDecoder())
    request.sequences.append(seq)
    return seq


class _TextRequest:
    images = None
    adapter: LoraModel | None = None


class RunnerSeq:
    """What the model runner reads of a sequence: its tokens to prefill, its slot, its shared
    prefix (none by default), and a request without images, on the base model or an adapter."""

    def __init__(
        self, tokens: list[int], slot: int, prefix_slot: int | None = None, shared_len: int = 0,
        adapter: LoraModel | None = None,
    ) -> None:  # fmt: skip
        self.sched = SchedulingState(tokens, slot=slot)
        self.prefix = PrefixLink(PrefixSlot(prefix_slot) if prefix_slot is not None else None, shared_len)
        self.request = _TextRequest()
        self.request.adapter = adapter
