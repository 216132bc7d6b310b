"""An embedding job's result → one OpenAI ``embedding`` list response."""

from __future__ import annotations

import base64
from array import array

from api.render.accumulator import JobResult, collect
from api.render.events import JobEvents
from api.wire.openai.embeddings import Embedding, EmbeddingResponse, EmbeddingUsage
from shared.errors import ErrorKind, RelayError


def _base64_float32(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    values = array("f", vector)
    if array("H", [1]).tobytes()[0] != 1:  # big-endian host
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


async def collect_embeddings(stream: JobEvents, encoding_format: str) -> EmbeddingResponse:
    model = stream.job.request.model
    result = await collect(stream, JobResult(num_choices=0))
    if result.embeddings is None or result.usage is None:
        raise RelayError(ErrorKind.INTERNAL, f"job {stream.job_id} ended without embeddings")
    num_prompt_tokens = result.usage.prompt_tokens
    usage = EmbeddingUsage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
    encode = _base64_float32 if encoding_format == "base64" else list
    data = [Embedding(index=index, embedding=encode(vector)) for index, vector in enumerate(result.embeddings)]
    return EmbeddingResponse(data=data, model=model, usage=usage)
