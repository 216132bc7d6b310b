"""Job events → one OpenAI ``embedding`` list response."""

from __future__ import annotations

import base64
from array import array

from api.jobs.stream import JobEvents
from shared.errors import ErrorKind, RelayError
from shared.events import EmbeddingsEvent, EndEvent, ErrorEvent
from shared.openai.embeddings import Embedding, EmbeddingResponse, EmbeddingUsage


def _base64_float32(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    values = array("f", vector)
    if array("H", [1]).tobytes()[0] != 1:  # big-endian host
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


async def collect_embeddings(stream: JobEvents, encoding_format: str) -> EmbeddingResponse:
    vectors: list[list[float]] | None = None
    usage: EmbeddingUsage | None = None
    try:
        async for event in stream.events():
            if isinstance(event, EmbeddingsEvent):
                vectors = event.vectors
            elif isinstance(event, EndEvent):
                usage = EmbeddingUsage(prompt_tokens=event.usage.prompt_tokens, total_tokens=event.usage.prompt_tokens)
            elif isinstance(event, ErrorEvent):
                raise event.to_exception()
    finally:
        await stream.close()
    if vectors is None or usage is None:
        raise RelayError(ErrorKind.INTERNAL, f"job {stream.job_id} ended without embeddings")
    encode = _base64_float32 if encoding_format == "base64" else list
    data = [Embedding(index=index, embedding=encode(vector)) for index, vector in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=stream.job.request.model, usage=usage)
