"""Prompts of an exact token length after the chat template, distinct per request so that no
prefix is shared (prefix caching would otherwise flatter the engine)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_FILLER = "the quick brown fox jumps over the lazy dog while the river keeps flowing to the sea"


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def user_text_for_length(tokenizer: PreTrainedTokenizerBase, index: int, num_tokens: int) -> str:
    """A user message whose templated prompt is exactly ``num_tokens`` long (or as close as words allow)."""
    words = f"Request {index}: {(_FILLER + ' ') * 64}".split()
    low, high = 1, len(words)
    while low < high:  # the longest word prefix that fits
        middle = (low + high + 1) // 2
        if len(chat_prompt_ids(tokenizer, [{"role": "user", "content": " ".join(words[:middle])}])) <= num_tokens:
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])


def distinct_prompts(tokenizer: PreTrainedTokenizerBase, count: int, num_tokens: int) -> list[str]:
    return [user_text_for_length(tokenizer, index, num_tokens) for index in range(count)]
