"""msgpack serializers for arq, which pickles by default (code execution for anyone who can write
to Redis). Both the API's pool and the worker must use these."""

from __future__ import annotations

import logging
from typing import Any

import msgpack

logger = logging.getLogger(__name__)

_PICKLE_PROTOCOL_MARKER = 0x80


class UnsafePayloadError(ValueError):
    """A payload that is not msgpack (e.g. a planted pickle) was refused."""


def serialize(obj: Any) -> bytes:
    return msgpack.packb(obj)


def deserialize(payload: bytes) -> Any:
    """Decode msgpack strictly; anything else is refused and logged, never executed."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        looks_pickled = bool(payload) and payload[0] == _PICKLE_PROTOCOL_MARKER
        logger.error("refused a non-msgpack payload of %d bytes (pickle=%s)", len(payload), looks_pickled)
        raise UnsafePayloadError("payload is not msgpack; refusing to decode it") from exc
