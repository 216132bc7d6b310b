"""The job contract: what an API process writes into Redis and a worker reads, versioned.

A job is built and validated at the edge (the API process), from whichever protocol the client
spoke (chat, completions, Responses, Messages, a batch line, a background job), into one
engine-native request: messages or prompts, sampling, stops, tools and output format, limits,
priority and owner. Workers read nothing else: no OpenAI or Anthropic wire model crosses the
process boundary, so changing a wire schema never changes what workers read.

The payload is stored in the job's record (``RedisKeys.job``, field ``request``); queues carry
only the job id. It is JSON, not msgpack: tool schemas are arbitrary JSON, whose integers may
exceed msgpack's 64 bits. Every payload names its ``version``. The models are this release's
(``job.py``), and the contract grows by fields that say since which version they exist:

- a reader upgrades an older version it supports (each step a frozen function of the payload
  alone) and refuses a newer one with :class:`NewerContract`, which a worker answers by leaving
  the job to a worker that reads it;
- a writer writes the newest version every live worker of the job's model reads (workers say
  which in their registry record): the job with the newer fields left out where they hold their
  defaults, or not at all where they do not (``since.py``), so an API and workers one release
  apart interoperate in either order of upgrade.

Support: a release reads and writes every version back to ``OLDEST_VERSION``, the version of the
release before the one that added the newest; job records live a day (``RedisKeys``), so a fleet
upgraded one release at a time never holds a job older than that.

``delivery`` is how the answer reaches the client (stream, usage chunk, echo, encoding): the API's
alone, so it is not in the payload but beside it in the job's record (``encode_delivery``; a
payload written by an older API may still carry it, and it is read from there), and changing it
never changes what workers read.
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

from shared.contract.job import (
    UPGRADES,
    VERSION,
    AnyJob,
    ChatJob,
    CompletionJob,
    Delivery,
    Embed,
    EmbeddingJob,
    Generate,
    ImagePart,
    ImageRef,
    Message,
    OutputFormat,
    Part,
    Sampling,
    TextPart,
    Tokenize,
    TokenizeJob,
    Tool,
    ToolCall,
    ToolChoice,
    Transcribe,
    TranscriptionJob,
    images_of,
)
from shared.contract.since import written_for

__all__ = [
    "CONTRACT_VERSION",
    "OLDEST_VERSION",
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
    "encode_delivery",
    "encode_job",
    "images_of",
    "payload_version",
]  # fmt: skip

CONTRACT_VERSION = VERSION
"""The version this code writes and the newest it reads."""
OLDEST_VERSION = 2
"""The oldest version this code reads, and writes for a reader of an older release."""


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
    older release is live for its model); ``ValueError`` for a job that version cannot carry."""
    if version == CONTRACT_VERSION:
        return job.model_dump_json().encode()
    if not OLDEST_VERSION <= version < CONTRACT_VERSION:
        raise ValueError(f"cannot write job contract version {version} (this release writes {OLDEST_VERSION} to "
                         f"{CONTRACT_VERSION})")  # fmt: skip
    return json.dumps({**written_for(job, version), "version": version}, ensure_ascii=False).encode()


def payload_version(data: object) -> int:
    """A payload's contract version; those of version 1 carry none."""
    if not isinstance(data, dict):
        raise UnreadableJob("a job payload is a JSON object")
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UnreadableJob(f"unknown job contract version {version!r}")
    return version


def encode_delivery(job: AnyJob) -> bytes:
    """The job's delivery options, kept beside its payload."""
    return job.delivery.model_dump_json().encode()


def decode_job(payload: bytes, delivery: bytes | None = None) -> AnyJob:
    """The job, upgraded to this version, with its ``delivery`` options where given;
    :class:`NewerContract` for a version written by newer code, :class:`UnreadableJob` for
    anything else that is not a job (an older version than ``OLDEST_VERSION`` included)."""
    job = _decode(payload)
    if delivery:
        try:
            return job.model_copy(update={"delivery": Delivery.model_validate_json(delivery)})
        except ValidationError as exc:
            raise UnreadableJob(f"delivery: {exc}") from None
    return job


def _decode(payload: bytes) -> AnyJob:
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnreadableJob(f"not JSON: {exc}") from None
    version = payload_version(data)
    if version > CONTRACT_VERSION:
        raise NewerContract(version)
    if version < OLDEST_VERSION:
        raise UnreadableJob(f"job contract version {version}; this process reads {OLDEST_VERSION} and newer")
    while version < CONTRACT_VERSION:
        data = UPGRADES[version](data)
        version += 1
    try:
        return _job_adapter.validate_python(data)
    except ValidationError as exc:
        raise UnreadableJob(str(exc)) from None
