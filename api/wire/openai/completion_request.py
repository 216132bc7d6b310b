"""``POST /v1/completions`` request body (OpenAI's legacy text completions)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from api.wire.openai.sampling_fields import SamplingFields

Prompt = str | list[str] | list[int] | list[list[int]]
MAX_PROMPTS = 64


class CompletionRequest(SamplingFields):
    """The OpenAI completions request: a prompt (a string, strings, token ids or lists of them)."""

    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=1, description="OpenAI's default, 16; null: the rest of the context.")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="Log-probabilities of the k likeliest tokens.")
    echo: bool = Field(default=False, description="Prepend the prompt to each choice's text.")
    suffix: str | None = Field(default=None, description="Not supported: any non-empty suffix is refused.")
    best_of: int | None = Field(default=None, ge=1, description="Only best_of == n (or unset) is supported.")

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be an empty list")
            if len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
                raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed")
            if any(isinstance(item, list) and not item for item in prompt):
                raise ValueError("token-id prompts must not be empty")
        return prompt

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.echo and not self.is_text_prompt:
            raise ValueError("echo is supported for string prompts only")
        return self

    @property
    def is_text_prompt(self) -> bool:
        return isinstance(self.prompt, str) or isinstance(self.prompt[0], str)

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list: strings, or token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return self.prompt

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_new_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs
