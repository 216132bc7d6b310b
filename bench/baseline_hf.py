"""(a) The seeds' approach: one Hugging Face ``generate`` call per request, one at a time."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from bench.stats import StreamTrace


class _TimingStreamer(BaseStreamer):
    """Records when ``generate`` hands over each new token (its first call carries the prompt)."""

    def __init__(self, trace: StreamTrace) -> None:
        self.trace = trace
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        self.trace.token_times.append(time.perf_counter())
        self.trace.num_tokens += 1

    def end(self) -> None:
        self.trace.finished_at = time.perf_counter()


def load_hf_model(source: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The same checkpoint through transformers, as the seeds load it (the engine runs relaylm's
    native forward where it applies)."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.inference_mode()
def run_serial_generate(model: torch.nn.Module, prompts: list[list[int]], output_tokens: int) -> list[StreamTrace]:
    traces = []
    for prompt in prompts:
        trace = StreamTrace(sent_at=time.perf_counter())
        model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=output_tokens,
            min_new_tokens=output_tokens,
            do_sample=False,
            streamer=_TimingStreamer(trace),
        )
        traces.append(trace)
    return traces
