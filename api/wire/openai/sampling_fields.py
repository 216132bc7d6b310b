"""Fields every generation request shares (chat and text completions), with their rules."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from shared.fair_share import PRIORITY_MAX, PRIORITY_MIN

MAX_STOP_SEQUENCES = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """OpenAI's sampling fields plus vLLM-named extensions; unknown fields are accepted, logged
    by name and dropped."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str = Field(min_length=1)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=16)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    user: str | None = None
    prompt_cache_key: str | None = Field(
        default=None,
        max_length=1024,
        description="Names requests that share a long prefix (a conversation, an agent): they are placed on the "
        "worker that served the last of them, where its prefix cache holds it; in place of `user`.",
    )
    # -- extensions (not in the OpenAI spec; vLLM's names) --------------------------------------
    priority: int = Field(
        default=0,
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        description="Extension: lower is sooner. Orders this key's own queued requests; across keys, the fair share "
        "decides (a key the admin lets rank across tenants: the priority first).",
    )
    top_k: int = Field(default=-1, ge=-1, description="Extension: keep the k most likely tokens; -1 or 0 = all.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Extension: drop tokens below min_p × p(top).")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=2.0, description="Extension: >1 discourages tokens already in prompt or output."
    )
    min_tokens: int = Field(default=0, ge=0, description="Extension: EOS and stop strings are ignored before this.")
    ignore_eos: bool = Field(default=False, description="Extension: keep generating past EOS (benchmarks).")
    stop_token_ids: list[NonNegativeInt] | None = Field(
        default=None, description="Extension: extra token ids that end a choice."
    )
    skip_special_tokens: bool = Field(default=True, description="Extension: drop special tokens from the text.")
    include_stop_str_in_output: bool = Field(
        default=False, description="Extension: a matched stop string ends the text instead of being cut from it."
    )
    resumable: bool = Field(
        default=False,
        description="Extension: keep generating when the client disconnects, so it can reconnect with Last-Event-ID.",
    )

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list):
            if len(stop) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
            if any(s == "" for s in stop):
                raise ValueError("stop sequences must not be empty")
        elif stop == "":
            raise ValueError("stop sequences must not be empty")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (integers from 0), got {token!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream=true")
        return self

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
