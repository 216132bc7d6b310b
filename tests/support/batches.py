"""A batch submitted as a client does: the JSONL file uploaded, then the batch created."""

from __future__ import annotations

import json
from typing import Any

import httpx


def submit_batch(base_url: str, bodies: list[dict[str, Any]]) -> str:
    """The new batch's id; line ``i`` (custom_id ``line-i``) posts ``bodies[i]`` to chat completions."""
    lines = [
        json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        for i, body in enumerate(bodies)
    ]
    files = {"file": ("batch.jsonl", "\n".join(lines).encode(), "application/jsonl")}
    uploaded = httpx.post(f"{base_url}/v1/files", data={"purpose": "batch"}, files=files, timeout=10)
    assert uploaded.status_code == 200, uploaded.text
    created = httpx.post(
        f"{base_url}/v1/batches",
        json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        timeout=10,
    )
    assert created.status_code == 200, created.text
    return str(created.json()["id"])
