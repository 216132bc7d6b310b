"""The job contract: what an API process writes into Redis and a worker reads, versioned.

A job is built and validated at the edge (the API process), from whichever protocol the client
spoke (chat, completions, Responses, Messages, a batch line, a background job), into one
engine-native request: messages or prompts, sampling, stops, tools and output format, limits,
priority and owner. Workers read nothing else: no OpenAI or Anthropic wire model crosses the
process boundary, so changing a wire schema never changes what workers read.

The payload is stored in the job's record (``RedisKeys.job``, field ``request``); queues carry
only the job id. It is JSON, not msgpack: tool schemas are arbitrary JSON, whose integers may
exceed msgpack's 64 bits. Every payload names its ``version``:

- a reader upgrades an older version it knows (version 2, whose messages are text only; version
  1, the OpenAI-shaped jobs of earlier releases, by :mod:`shared.contract.v1`) and refuses a
  newer one with :class:`NewerContract`, which a worker answers by leaving the job to a worker that reads it;
- a writer writes the newest version every live worker of the job's model reads (workers say
  which in their registry record), so an API and workers one release apart interoperate in
  either order of upgrade;
- within a version nothing changes: every model forbids unknown fields, so a payload is read
  exactly or not at all, never misread. A change of shape is a new version.

``delivery`` is how the answer reaches the client (stream, usage chunk, echo, encoding); API
processes read it to render the job's events, workers ignore it.
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

from shared.contract.v1 import downgrade_to_v1, upgrade_v1
from shared.contract.v2 import Delivery, Embed, OutputFormat, Sampling, Tool, ToolCall, ToolChoice, Transcribe
from shared.contract.v3 import (
    VERSION,
    AnyJob,
    ChatJob,
    CompletionJob,
    EmbeddingJob,
    Generate,
    ImagePart,
    ImageRef,
    Message,
    Part,
    TextPart,
    Tokenize,
    TokenizeJob,
    TranscriptionJob,
    downgrade_to_v2,
    images_of,
    upgrade_v2,
)

__all__ = [
    "CONTRACT_VERSION",
    "OLDEST_READABLE_VERSION",
    "AnyJob",
    "ChatJob",
    "CompletionJob",
    "Delivery",
    "Embed",
    "EmbeddingJob",
    "Generate",
    "ImagePart",
    "ImageRef",
    "Message",
    "NewerContract",
    "OutputFormat",
    "Part",
    "Sampling",
    "TextPart",
    "Tokenize",
    "TokenizeJob",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "Transcribe",
    "TranscriptionJob",
    "UnreadableJob",
    "decode_job",
    "encode_job",
    "images_of",
    "payload_version",
]  # fmt: skip

CONTRACT_VERSION = VERSION
"""The version this code writes and the newest it reads."""
OLDEST_READABLE_VERSION = 1


class UnreadableJob(ValueError):
    """The payload is not a job of any version this code knows."""


class NewerContract(UnreadableJob):
    """A job written in a newer contract version than this code reads (an upgrade in progress)."""

    def __init__(self, version: int) -> None:
        super().__init__(f"job contract version {version}; this process reads {CONTRACT_VERSION} and older")
        self.version = version


_job_adapter: TypeAdapter[AnyJob] = TypeAdapter(Annotated[AnyJob, Field(discriminator="kind")])


def encode_job(job: AnyJob, version: int = CONTRACT_VERSION) -> bytes:
    """``version``: the newest every reader of the job reads (an older one while a worker of the
    older release is live for its model)."""
    if version == CONTRACT_VERSION:
        return job.model_dump_json().encode()
    if version == 2:
        return json.dumps(downgrade_to_v2(job), ensure_ascii=False).encode()
    if version == 1:
        if isinstance(job, TranscriptionJob):
            raise ValueError("version 1 has no transcription jobs")
        if images_of(job):
            raise ValueError("version 1 has no images")
        return json.dumps(downgrade_to_v1(job), ensure_ascii=False).encode()
    raise ValueError(f"cannot write job contract version {version}")


def payload_version(data: object) -> int:
    """A payload's contract version; those of version 1 carry none."""
    if not isinstance(data, dict):
        raise UnreadableJob("a job payload is a JSON object")
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < OLDEST_READABLE_VERSION:
        raise UnreadableJob(f"unknown job contract version {version!r}")
    return version


def decode_job(payload: bytes) -> AnyJob:
    """The job, upgraded to this version; :class:`NewerContract` for a version written by newer
    code, :class:`UnreadableJob` for anything else that is not a job."""
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnreadableJob(f"not JSON: {exc}") from None
    version = payload_version(data)
    if version > CONTRACT_VERSION:
        raise NewerContract(version)
    if version == 1:
        try:
            data = upgrade_v1(data)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise UnreadableJob(f"not a version-1 job: {exc!r}") from None
    if version <= 2:
        data = upgrade_v2(data)
    try:
        return _job_adapter.validate_python(data)
    except ValidationError as exc:
        raise UnreadableJob(str(exc)) from None
