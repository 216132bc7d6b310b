"""A background chat completion before it has a result."""

from __future__ import annotations

from typing import Any

from shared.contract import AnyJob


def background_summary(job: AnyJob, status: str) -> dict[str, Any]:
    """What a background job looks like before it has a result: a ``chat.completion`` with no choices."""
    return {
        "id": job.job_id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.served_name,
        "status": status,
        "choices": [],
    }
