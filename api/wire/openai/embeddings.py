"""``POST /v1/embeddings`` request and response."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

EmbeddingInput = str | list[str] | list[int] | list[list[int]]
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    input: EmbeddingInput
    model: str = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, description="Only the model's own size is supported.")
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _input_shape(cls, value: EmbeddingInput) -> EmbeddingInput:
        if isinstance(value, list):
            if not value:
                raise ValueError("input must not be an empty list")
            if not isinstance(value[0], int) and len(value) > MAX_INPUTS:
                raise ValueError(f"at most {MAX_INPUTS} inputs are allowed")
            if any(isinstance(item, list | str) and not item for item in value):
                raise ValueError("inputs must not be empty")
        elif not value:
            raise ValueError("input must not be empty")
        return value

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [self.input]
        return self.input

    @property
    def is_text(self) -> bool:
        return isinstance(self.input, str) or isinstance(self.input[0], str)

    # Generation settings the shared job path reads; an embedding streams nothing.
    stream: bool = False
    n: int = 1
    resumable: bool = False


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 of little-endian float32 values.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
