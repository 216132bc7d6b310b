"""Logging for both processes: text or JSON lines, and one grep-able line per job transition.

A transition line reads ``job=<id> request_id=<rid> event=<name> key=value ...`` in text form;
in JSON form the same fields are top-level keys, so ``request_id`` can be followed across the
API's and the workers' logs either way.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

_TRANSITION_FIELDS = "relaylm_fields"


def _micros(created: float) -> int:
    return min(int((created % 1) * 1_000_000), 999_999)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            # Microseconds: the job transitions of one request, across processes, are that close.
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{_micros(record.created):06d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, _TRANSITION_FIELDS, {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_transition(logger: logging.Logger, event: str, job_id: str, request_id: str | None, **fields: Any) -> None:
    """One line per job state change, carrying the request id."""
    all_fields = {"job": job_id, "request_id": request_id, "event": event, **fields}
    text = " ".join(f"{key}={value}" for key, value in all_fields.items() if value is not None)
    logger.info(text, extra={_TRANSITION_FIELDS: all_fields})
