"""Turns one job's events into the latency and token metrics, as the client experiences them."""

from __future__ import annotations

import time

from api.metrics import Metrics
from shared.events import AnyEvent, DeltaEvent, EndEvent, ErrorEvent, StartEvent


class RequestObserver:
    def __init__(self, metrics: Metrics, model: str, arrived_at: float) -> None:
        self._metrics = metrics
        self._model = model
        self._arrived_at = arrived_at
        self._enqueued_at: float | None = None
        self._last_token_at: float | None = None

    def enqueued(self) -> None:
        self._enqueued_at = time.monotonic()

    def observe(self, event: AnyEvent) -> None:
        now, m, model = time.monotonic(), self._metrics, self._model
        if isinstance(event, StartEvent) and self._enqueued_at is not None:
            m.queue_time.labels(model).observe(now - self._enqueued_at)
        elif isinstance(event, DeltaEvent):
            if event.content or event.reasoning or event.tool_calls:
                if self._last_token_at is None:
                    m.ttft.labels(model).observe(now - self._arrived_at)
                else:
                    m.itl.labels(model).observe(now - self._last_token_at)
                self._last_token_at = now
            if event.finish_reason:
                m.request_success.labels(model, event.finish_reason).inc()
        elif isinstance(event, EndEvent):
            m.e2e.labels(model).observe(now - self._arrived_at)
            m.prompt_tokens.labels(model).inc(event.usage.prompt_tokens)
            m.generation_tokens.labels(model).inc(event.usage.completion_tokens)
        elif isinstance(event, ErrorEvent):
            self.failed(event.kind.value)

    def failed(self, code: str) -> None:
        self._metrics.request_failure.labels(self._model, code).inc()
