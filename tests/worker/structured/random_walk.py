"""Decoding with random logits: a stand-in for a model that can take any path a grammar allows,
not only the likely ones, so a test sees what the mask really lets through."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from worker.structured import CompiledConstraint, allocate_token_bitmask, apply_token_bitmasks_

MAX_TOKENS = 400
# Random tokens almost never close a string or spell a closing tag, so a walk would rarely end
# within budget. With this chance per step it starts steering toward one of these texts: each of
# its tokens gets a large boost while the mask allows it. Tokens are still drawn from the masked
# distribution, so steering only changes which allowed path is taken.
STEER_PROBABILITY = 0.35
EXIT_TEXTS = ('"', "}", "]", "\n</parameter>\n")
STEER_BOOST = 100.0


@dataclass
class Walk:
    token_ids: list[int]  # including the final stop token when terminated
    is_terminated: bool
    text: str  # the constrained text: the tokens before the stop token, decoded
    last_bitmask: torch.Tensor  # the mask of the final step (the one that allowed the stop token)


def random_walk(compiled: CompiledConstraint, tokenizer: PreTrainedTokenizerBase, vocab_size: int, seed: int) -> Walk:
    generator = torch.Generator().manual_seed(seed)
    exits = [tokenizer.encode(text, add_special_tokens=False) for text in EXIT_TEXTS]
    exits += [[token_id] for token_id in sorted(compiled.stop_token_ids)]
    matcher = compiled.new_matcher()
    bitmask = allocate_token_bitmask(1, vocab_size)
    token_ids: list[int] = []
    steering: list[int] = []
    while not matcher.is_terminated and len(token_ids) < MAX_TOKENS:
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not steering and _uniform(generator) < STEER_PROBABILITY:
            steering = list(exits[int(torch.randint(len(exits), (1,), generator=generator))])
        logits = torch.randn(1, vocab_size, generator=generator)
        if steering:
            logits[0, steering[0]] += STEER_BOOST
        apply_token_bitmasks_(logits, bitmask, [0])
        token_id = _sample(logits[0], generator)
        steering = steering[1:] if steering and steering[0] == token_id else []
        assert matcher.accept_token(token_id), matcher.error_message
        token_ids.append(token_id)
    body = token_ids[:-1] if matcher.is_terminated else token_ids
    text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return Walk(token_ids, matcher.is_terminated, text, bitmask[0].clone())


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    """The token ids whose bit is set in one bitmask row."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab_size].nonzero().flatten().tolist())


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator))


def _sample(logits: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw from softmax(logits): one uniform number, far cheaper than multinomial."""
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
    target = (1.0 - _uniform(generator)) * cdf[-1]
    return int(torch.searchsorted(cdf, target.reshape(1)).clamp(max=logits.shape[0] - 1))
