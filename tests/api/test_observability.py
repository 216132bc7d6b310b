"""Prometheus metrics move by the expected amounts; request ids travel through API and worker logs."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY_MODEL, make_stack
from tests.support.stack import Stack

BODY = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 3, "ignore_eos": True}


def _samples(stack: Stack) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{stack.base_url}/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_count_known_requests(tiny_stack: Stack) -> None:
    before = _samples(tiny_stack)
    for stream in (False, True):
        response = httpx.post(f"{tiny_stack.base_url}/v1/chat/completions", json={**BODY, "stream": stream}, timeout=30)
        assert response.status_code == 200
        _ = response.text
    time.sleep(0.2)  # the stream's last bookkeeping runs after [DONE] is sent
    after = _samples(tiny_stack)
    model = {"model": TINY_MODEL}
    assert (
        _value(after, "relaylm:generation_tokens_total", **model)
        - _value(before, "relaylm:generation_tokens_total", **model)
        == 6
    )
    prompt_delta = _value(after, "relaylm:prompt_tokens_total", **model) - _value(
        before, "relaylm:prompt_tokens_total", **model
    )
    assert prompt_delta > 0 and prompt_delta % 2 == 0
    success = {"model": TINY_MODEL, "finished_reason": "length"}
    assert (
        _value(after, "relaylm:request_success_total", **success)
        - _value(before, "relaylm:request_success_total", **success)
        == 2
    )
    assert (
        _value(after, "relaylm:time_to_first_token_seconds_count", **model)
        - _value(before, "relaylm:time_to_first_token_seconds_count", **model)
        == 2
    )
    assert (
        _value(after, "relaylm:e2e_request_latency_seconds_count", **model)
        - _value(before, "relaylm:e2e_request_latency_seconds_count", **model)
        == 2
    )
    route = {"route": "/v1/chat/completions", "method": "POST", "status": "200"}
    assert (
        _value(after, "relaylm:http_requests_total", **route) - _value(before, "relaylm:http_requests_total", **route)
        == 2
    )
    assert _value(after, "relaylm:live_workers", **model) == 1
    placed_nowhere = {"model": TINY_MODEL, "outcome": "none"}  # a one-message conversation places nothing
    assert (
        _value(after, "relaylm:placements_total", **placed_nowhere)
        - _value(before, "relaylm:placements_total", **placed_nowhere)
        == 2
    )
    for lane in ("interactive", "batch"):
        assert ("relaylm:queue_backlog", frozenset({**model, "lane": lane}.items())) in after
        assert ("relaylm:queue_prefill_tokens", frozenset({**model, "lane": lane}.items())) in after
    assert ("relaylm:model_prefix_cache_hit_rate", frozenset(model.items())) in after
    assert "# TYPE relaylm:placements_spilled_total counter" in httpx.get(f"{tiny_stack.base_url}/metrics").text
    worker = {"model": TINY_MODEL, "worker": f"{tiny_stack.key_prefix}-worker0"}
    assert ("relaylm:num_requests_running", frozenset(worker.items())) in after


def test_request_id_is_returned_and_logged_by_both_processes(tiny_stack: Stack) -> None:
    response = httpx.post(
        f"{tiny_stack.base_url}/v1/chat/completions", json=BODY, headers={"x-request-id": "trace-me-42"}, timeout=30
    )
    assert response.headers["x-request-id"] == "trace-me-42"
    assert response.json()["id"].startswith("chatcmpl-trace-me-42-")
    assert tiny_stack.api is not None
    deadline = time.monotonic() + 5
    while "request_id=trace-me-42 event=finished" not in tiny_stack.workers[0].log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "request_id=trace-me-42 event=queued" in tiny_stack.api.log()
    assert "request_id=trace-me-42 event=finished" in tiny_stack.workers[0].log()
    generated = httpx.post(f"{tiny_stack.base_url}/v1/chat/completions", json=BODY, timeout=30)
    assert generated.json()["id"] == f"chatcmpl-{generated.headers['x-request-id']}"


@pytest.fixture
def json_log_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api(log_format="json")
        stack.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=256, log_format="json")
        yield stack
    finally:
        stack.stop()


def test_json_logs_carry_the_request_id_as_a_field(json_log_stack: Stack) -> None:
    httpx.post(
        f"{json_log_stack.base_url}/v1/chat/completions", json=BODY, headers={"x-request-id": "json-7"}, timeout=30
    )
    time.sleep(0.3)
    assert json_log_stack.api is not None
    records = [json.loads(line) for line in json_log_stack.api.log().splitlines() if line.startswith("{")]
    queued = [r for r in records if r.get("event") == "queued"]
    assert queued and queued[0]["request_id"] == "json-7" and queued[0]["job"].startswith("chatcmpl-json-7-")
    worker_records = [json.loads(line) for line in json_log_stack.workers[0].log().splitlines() if line.startswith("{")]
    assert any(r.get("request_id") == "json-7" and r.get("event") == "started" for r in worker_records)


def test_the_grafana_dashboard_uses_only_metrics_the_api_serves(tiny_stack: Stack) -> None:
    dashboard = json.loads(
        (Path(__file__).resolve().parents[2] / "docs" / "grafana" / "relaylm-dashboard.json").read_text()
    )
    families = text_string_to_metric_families(httpx.get(f"{tiny_stack.base_url}/metrics").text)
    served = {family.name + suffix for family in families for suffix in ("", "_total", "_bucket", "_count", "_sum")}
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {match for expr in expressions for match in re.findall(r"relaylm:[a-z0-9_]+", expr)}
    assert used and used <= served, used - served
