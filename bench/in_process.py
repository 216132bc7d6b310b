"""(b) The engine in this process, without Redis or HTTP: isolates what the queue hop costs.

Each request goes through the same preparation as through the stack (the API's contract
request, then the worker's chat template, tokenization and sampling parameters) inside the
timed region, so the difference to the full
stack is exactly API + Redis queue + pub/sub. The loop runs on this (main) thread, the thread
that already ran the baseline: torch work on a second thread would run slower (see
worker/service/engine_thread.py).
"""

from __future__ import annotations

import threading
import time

from api.jobs.build import chat_generate
from api.wire.openai.chat_request import ChatCompletionRequest
from bench.stats import StreamTrace
from shared.events import DeltaEvent, EndEvent
from worker.engine.builder import EngineConfig, build_engine
from worker.engine.engine import LLMEngine, RequestOutput
from worker.engine.shared_prefix import SharedPrefixes
from worker.models.loader import LoadedModel
from worker.requests.params import RequestLimits
from worker.requests.prepare import prepare_chat
from worker.requests.tooling import resolve_tooling


class _TraceSink:
    def __init__(self) -> None:
        self.traces: dict[str, StreamTrace] = {}
        self.done = threading.Event()
        self.pending = 0
        self._lock = threading.Lock()

    def __call__(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for output in outputs:
            trace = self.traces[output.request_id]
            for event in output.events:
                if isinstance(event, DeltaEvent):
                    trace.token_ids += event.token_ids
                if isinstance(event, DeltaEvent) and event.content:
                    trace.token_times.append(now)
                elif isinstance(event, EndEvent):
                    trace.num_tokens = event.usage.completion_tokens
                    trace.finished_at = now
            if output.is_done:
                with self._lock:
                    self.pending -= 1
                    if self.pending == 0:
                        self.done.set()


class InProcessEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.tooling = resolve_tooling(loaded.tokenizer, "auto", "auto", generic_tool_prompt=False)
        self.sink = _TraceSink()
        self.engine: LLMEngine = build_engine(loaded.model, loaded.tokenizer, config, loaded.eos_token_ids, self.sink)
        self._next_id = 0
        self.peak_running = 0  # the most sequences one step ran, over every run
        self.peak_kv_blocks = 0  # the most KV blocks held after one step, over every run
        self.peak_shared_blocks = 0  # of which held once for every sequence that reads them

    def run(self, bodies: list[dict[str, object]]) -> list[StreamTrace]:
        """Submit every request at once; return their traces when all have finished."""
        self.sink.done.clear()
        self.sink.pending = len(bodies)
        traces = []
        for body in bodies:
            request_id = f"bench-{self._next_id}"
            self._next_id += 1
            trace = StreamTrace(sent_at=time.perf_counter())
            self.sink.traces[request_id] = trace
            traces.append(trace)
            request = chat_generate(ChatCompletionRequest.model_validate(body))  # what the API sends
            limits = RequestLimits(self.engine.max_running)
            self.engine.submit(prepare_chat(request_id, request, self.loaded, self.tooling, limits))
        while not self.sink.done.is_set():
            self.engine.run_step()
            self.peak_running = max(self.peak_running, self.engine.num_running)
            scheduler = self.engine.scheduler
            if scheduler.budget.num_used > self.peak_kv_blocks:
                self.peak_kv_blocks = scheduler.budget.num_used
                prefixes = scheduler.prefixes
                self.peak_shared_blocks = prefixes.num_shared_blocks if isinstance(prefixes, SharedPrefixes) else 0
        return traces

    def run_sequential(self, bodies: list[dict[str, object]]) -> list[StreamTrace]:
        return [trace for body in bodies for trace in self.run([body])]

    def prefix_hit_rate(self) -> float | None:
        return self.engine.load().prefix_cache_hit_rate

    def close(self) -> None:
        """Release the KV cache before the next mode loads its own."""
        del self.engine
