"""One sequence's position in its grammar: which tokens may come next, and the token that came."""

from __future__ import annotations

import llguidance
import torch


class ConstraintMatcher:
    """Owned by one sequence; advanced by every token it samples.

    Once the constrained text is complete the mask allows only the stop tokens, and accepting
    one of them terminates the matcher. A rejected token leaves the matcher in an error state
    for good (the sequence should then be aborted, not continued unconstrained).
    """

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._has_stopped = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit ``t % 32`` of word
        ``t // 32`` set = token ``t`` allowed); see :func:`allocate_token_bitmask`.

        Written straight into the tensor's memory: ``llguidance.torch`` does the same but imports
        ``torch.compile`` machinery (seconds of start-up) for a kernel not used here.
        """
        target = bitmask[row]
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not target.is_contiguous():
            raise ValueError("the token bitmask must be a contiguous int32 CPU tensor")
        # The library checks the byte size against its vocabulary before writing.
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def accept_token(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar forbids it (or had terminated)."""
        if self._has_stopped:
            return False
        if not self._matcher.consume_token(token_id):
            return False
        self._has_stopped = token_id in self._stop_token_ids
        return True

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the sequence ends here."""
        return self._has_stopped

    @property
    def is_error(self) -> bool:
        return self._matcher.is_error()

    @property
    def error_message(self) -> str:
        return self._matcher.get_error()
