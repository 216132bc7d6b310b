"""Prompts of an exact token length after the chat template, distinct per request so that no
prefix is shared (prefix caching would otherwise flatter the engine)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_FILLER = "the quick brown fox jumps over the lazy dog while the river keeps flowing to the sea"


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def fit_words(tokenizer: PreTrainedTokenizerBase, words: list[str], num_tokens: int) -> str:
    """The longest prefix of ``words`` whose templated prompt (one user message) is at most
    ``num_tokens`` long."""
    low, high = 1, len(words)
    while low < high:
        middle = (low + high + 1) // 2
        if len(chat_prompt_ids(tokenizer, [{"role": "user", "content": " ".join(words[:middle])}])) <= num_tokens:
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])


def user_text_for_length(tokenizer: PreTrainedTokenizerBase, index: int, num_tokens: int) -> str:
    """A user message whose templated prompt is exactly ``num_tokens`` long (or as close as words
    allow): the filler repeated past the length (every word is at least one token)."""
    filler = _FILLER.split()
    return fit_words(tokenizer, [f"Request {index}:", *filler * (num_tokens // len(filler) + 1)], num_tokens)


def distinct_prompts(tokenizer: PreTrainedTokenizerBase, count: int, num_tokens: int) -> list[str]:
    return [user_text_for_length(tokenizer, index, num_tokens) for index in range(count)]
