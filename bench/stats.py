"""Per-run measurements and their summary (percentiles in milliseconds, throughput in tok/s)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


def percentile_ms(values_s: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values_s) * 1000.0, q)) if values_s else None


@dataclass
class StreamTrace:
    """Arrival times (seconds, one clock) of one request's events."""

    sent_at: float
    token_times: list[float] = field(default_factory=list)  # arrival of each delta carrying text
    num_tokens: int = 0
    finished_at: float = 0.0
    token_ids: list[int] = field(default_factory=list)  # generated ids, where the runner sees them

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first, over the time after the first (the batch-1 decode rate)."""
        if len(self.token_times) < 2 or self.finished_at <= self.token_times[0]:
            return None
        return (self.num_tokens - 1) / (self.finished_at - self.token_times[0])


@dataclass
class RunSummary:
    mode: str
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    decode_tok_s: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(mode: str, concurrency: int, traces: list[StreamTrace]) -> RunSummary:
    started = min(trace.sent_at for trace in traces)
    finished = max(trace.finished_at for trace in traces)
    tokens = sum(trace.num_tokens for trace in traces)
    ttfts = [t for t in (trace.ttft_s for trace in traces) if t is not None]
    itls = [gap for trace in traces for gap in trace.itl_s]
    decode_rates = [r for r in (trace.decode_tok_s for trace in traces) if r is not None]
    return RunSummary(
        mode=mode,
        concurrency=concurrency,
        num_requests=len(traces),
        output_tokens=tokens,
        wall_s=finished - started,
        tok_s=tokens / (finished - started),
        ttft_p50_ms=percentile_ms(ttfts, 50),
        ttft_p99_ms=percentile_ms(ttfts, 99),
        itl_p50_ms=percentile_ms(itls, 50),
        itl_p99_ms=percentile_ms(itls, 99),
        decode_tok_s=float(np.median(decode_rates)) if decode_rates else None,
    )
