"""The generation worker: a causal LM behind the continuous-batching engine, for chat,
text-completion and tokenize jobs."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Literal, cast

import torch

from shared.adapter_files import AdapterError
from shared.adapters import NAME
from shared.contract import AnyJob, ChatJob, CompletionJob, TokenizeJob
from shared.errors import ErrorKind, RelayError
from shared.events import AnyEvent, DeltaEvent, EndEvent, UsageCounts
from shared.placement import adapter_key, follows_cache
from shared.registry import WorkerInfo, WorkerTask
from worker.adapters.cache import AdapterCache, LocalAdapter, parse_lora_flag, read_local
from worker.engine.builder import EngineConfig, build_engine, default_max_num_batched_tokens
from worker.engine.detokenizer import Decoder
from worker.engine.engine import KeysReleased, LLMEngine, OutputSink
from worker.engine.self_test import PassedSelfTests, check_determinism
from worker.engine.sequence import EngineRequest, PrefixKeys, ResumeState
from worker.kinds.base import Answer, ImageBytes, JobInputs, Readiness, wrong_task
from worker.models.loader import LoadedModel, ModelLoadError, load_model
from worker.native.compiled_decode import CompiledDecode, can_compile
from worker.native.decoder import NativeCausalLM
from worker.native.lora import LoraModel, model_shapes
from worker.requests.params import RequestLimits
from worker.requests.prepare import chat_prompt_ids, prepare_chat, prepare_completion
from worker.requests.tooling import ToolingConfig, resolve_tooling
from worker.settings import WorkerSettings
from worker.structured import ConstraintCompiler

logger = logging.getLogger("relaylm.worker")


class GenerationHandler:
    def __init__(
        self,
        loaded: LoadedModel,
        tooling: ToolingConfig,
        engine: LLMEngine,
        max_tokens_over_context: Literal["clamp", "error"] = "clamp",
        max_n: int | None = None,
        adapters: AdapterCache | None = None,
        model_id: str = "",
    ) -> None:
        """``max_n``: the most choices one request may ask for (the worker's ``--max-num-seqs``);
        ``adapters``: the LoRA adapters it holds ready (None: it serves none); ``model_id``: the
        model name jobs and adapters name."""
        self.loaded = loaded
        self.adapters = adapters
        self.model_id = model_id
        self.tooling = tooling
        self.engine = engine
        self.max_tokens_over_context = max_tokens_over_context
        self.max_n = engine.max_running if max_n is None else max_n
        self._compiler: ConstraintCompiler | None = None
        # Preparing renders the chat template, tokenizes and compiles grammars (the first
        # constrained request builds a token trie: seconds for a 150k-token vocabulary). On a
        # thread of its own, one request at a time, the event loop keeps the heartbeat and the
        # other jobs' events going meanwhile.
        self._preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")

    def get_compiler(self) -> ConstraintCompiler:
        """Built on the first constrained request: its token trie takes about a second to make."""
        if self._compiler is None:
            self._compiler = ConstraintCompiler(
                self.loaded.tokenizer, self.engine.runner.vocab_size, self.loaded.eos_token_ids
            )
        return self._compiler

    async def prepare(self, job: AnyJob, inputs: JobInputs) -> EngineRequest | Answer:
        loop = asyncio.get_running_loop()
        if isinstance(job, TokenizeJob):
            images = await inputs.images(job)
            return await loop.run_in_executor(self._preparer, self.tokenize, job, images)
        if not isinstance(job, ChatJob | CompletionJob):
            raise wrong_task(job, "chat and text completions")
        resume = _resume_state(inputs.claim.next_seq, await inputs.sent())
        adapter = await self._adapter(job.request.adapter, inputs) if job.request.adapter is not None else None
        images = await inputs.images(job)
        limits = RequestLimits(self.max_n, self.max_tokens_over_context)
        if isinstance(job, ChatJob):
            chat = functools.partial(
                prepare_chat, job.job_id, job.request, self.loaded, self.tooling, limits, self.get_compiler, images
            )
            request = await loop.run_in_executor(self._preparer, chat)
        else:
            completion = functools.partial(prepare_completion, job.job_id, job.request, self.loaded, limits)
            request = await loop.run_in_executor(self._preparer, completion)
        request.resume = resume
        request.adapter = adapter
        request.priority = job.request.priority
        # The keys its conversation's prompt stands for; affinity names are held whatever is cached.
        cached_keys = tuple(key for key in inputs.claim.prefix_keys if follows_cache(key))
        if cached_keys:
            request.prefix_keys = PrefixKeys(cached_keys, inputs.claim.claimed_ms)
        return request

    async def _adapter(self, name: str, inputs: JobInputs) -> LoraModel:
        """The job's adapter, ready: held here, else fetched from Redis and made ready (once)."""
        if self.adapters is None:
            raise RelayError(ErrorKind.INVALID_REQUEST, "This worker's model serves no LoRA adapters.", "model")
        record = await inputs.adapter(name)
        if record.base != self.model_id:
            message = f"The adapter `{name}` adapts `{record.base}`, not `{self.model_id}`."
            raise RelayError(ErrorKind.INVALID_REQUEST, message, "model")
        self.adapters.claimed(name, inputs.claim.claimed_ms)
        ready = self.adapters.get(record)
        if ready is not None:
            return ready
        config, weights = await inputs.adapter_files(record)
        make = functools.partial(self.adapters.make_from_files, record, config, weights)
        try:
            ready = await asyncio.get_running_loop().run_in_executor(self._preparer, make)
        except AdapterError as exc:
            raise RelayError(
                ErrorKind.INVALID_REQUEST, f"The adapter `{name}` cannot be served: {exc}", "model"
            ) from exc
        logger.info("LoRA adapter %s fetched from Redis and ready (%s; %.1f MiB)", name, record.sha256[:12],
                    ready.nbytes / 2**20)  # fmt: skip
        return ready

    def tokenize(self, job: TokenizeJob, images: ImageBytes) -> Answer:
        """Its token ids and (detokenizing) their text, in one delta; the engine never sees the job."""
        token_ids, text = self._tokens(job, images)
        count = len(token_ids)
        events: list[AnyEvent] = [
            DeltaEvent(seq=1, token_ids=token_ids, content=text),
            EndEvent(seq=2, usage=UsageCounts(prompt_tokens=count, completion_tokens=0)),
        ]
        return Answer(count, events)

    def _tokens(self, job: TokenizeJob, images: ImageBytes) -> tuple[list[int], str | None]:
        request, tokenizer = job.request, self.loaded.tokenizer
        if request.tokens is not None:
            vocab_size = self.loaded.vocab_size
            outside = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
            if outside is not None:
                message = f"Token id {outside} is outside this model's vocabulary [0, {vocab_size})."
                raise RelayError(ErrorKind.INVALID_REQUEST, message, "tokens")
            return request.tokens, cast(str, tokenizer.decode(request.tokens))  # one sequence: one string
        if request.chat is not None:
            return chat_prompt_ids(request.chat, self.loaded, self.tooling, images), None
        return tokenizer.encode(request.prompt or "", add_special_tokens=request.add_special_tokens), None


def _resume_state(next_seq: int, sent: list[AnyEvent] | None) -> ResumeState | None:
    """Where an earlier attempt stopped: the tokens it sent per choice, and the choices it ended."""
    if sent is None:
        return None
    tokens: dict[int, list[int]] = {}
    finished: set[int] = set()
    for event in sent:
        if isinstance(event, DeltaEvent):
            tokens.setdefault(event.index, []).extend(event.token_ids)
            if event.finish_reason is not None:
                finished.add(event.index)
    return ResumeState(next_seq, tokens, frozenset(finished))


class GenerateKind:
    task: WorkerTask = "generate"

    def __init__(self, settings: WorkerSettings, sink: OutputSink) -> None:
        self.settings = settings
        self._sink = sink
        self._loaded: LoadedModel | None = None
        self._engine: LLMEngine | None = None
        self._deterministic: bool | None = None
        self._compiled: CompiledDecode | None = None
        self._adapters: AdapterCache | None = None
        self._local_adapters: list[LocalAdapter] = []

    def start(self) -> LLMEngine:
        s = self.settings
        loaded = self._loaded = load_model(
            s.model, s.cache_dir, s.device, s.dtype, s.max_model_len, s.model_impl, s.quantization,
            deterministic=s.deterministic == "on",
        )  # fmt: skip
        device = _device(loaded)
        config = EngineConfig(
            max_num_seqs=s.max_num_seqs + self._fair_share_slots,
            max_num_batched_tokens=s.max_num_batched_tokens or default_max_num_batched_tokens(device),
            max_model_len=loaded.max_model_len,
            kv_cache_bytes=int(s.kv_cache_memory_gib * 2**30),
            prefix_cache_bytes=int(s.prefix_cache_memory_gib * 2**30),
            speculative=s.speculative,
        )
        plan = config.plan_for(loaded.model, device, compiled_step=self._wants_compiled_step())
        logger.info("execution plan: %s", plan.describe())
        engine = self._engine = build_engine(
            loaded.model, _decoder(loaded), config, loaded.eos_token_ids, self._sink, plan
        )
        if plan.is_exact:
            self._test_determinism(loaded)
            if not self._deterministic and engine.drafter is not None:
                logger.warning("speculation is off: it keeps the text only where the self-test passes")
                engine.drafter = None
        elif s.speculative == "ngram":
            logger.info("--deterministic off: speculation is off (it could change the text there)")
        if plan.compiled_step:
            self._compile_decode(loaded, engine)
        self._ready_adapters(loaded, plan.is_exact)
        return engine

    def _ready_adapters(self, loaded: LoadedModel, exact: bool) -> None:
        """The adapter cache of a native model, with the ``--lora`` adapters checked and made ready
        (``ModelLoadError`` for one that cannot be served: the worker does not start half-configured)."""
        s = self.settings
        model = loaded.model
        if not isinstance(model, NativeCausalLM):
            if s.lora:
                raise ModelLoadError("--lora needs the native forward (--model-impl native), which this model lacks")
            return
        self._adapters = AdapterCache(model, exact, s.max_loras, s.max_lora_rank)
        try:
            for name, folder in parse_lora_flag(s.lora):
                if not NAME.match(name):
                    raise ValueError(f"--lora: {name!r} is not a usable name (letters, digits, . _ : / -)")
                local = read_local(name, folder)
                ready = self._adapters.make(name, local.sha256, local.adapter)
                self._local_adapters.append(local)
                logger.info("LoRA adapter %s ready (rank %d, %s; %.1f MiB)", name, local.adapter.rank,
                            ", ".join(sorted(local.adapter.targets)), ready.nbytes / 2**20)  # fmt: skip
        except (ValueError, OSError) as exc:  # AdapterError is a ValueError
            raise ModelLoadError(f"--lora: {exc}") from exc

    @property
    def _fair_share_slots(self) -> int:
        """Engine slots kept for quiet API keys' requests: none on a batch-only worker."""
        return 0 if self.settings.lanes == "batch" else self.settings.fair_share_slots

    def handler(self) -> GenerationHandler:
        loaded, engine = self._started()
        s = self.settings
        tooling = resolve_tooling(loaded.tokenizer, s.tool_parser, s.reasoning_parser, s.generic_tool_prompt)
        logger.info("tool parser: %s, reasoning parser: %s", tooling.tool_parser, tooling.reasoning_parser)
        max_n = engine.max_running - self._fair_share_slots
        return GenerationHandler(loaded, tooling, engine, s.max_tokens_over_context, max_n, self._adapters, s.model_id)

    def describe(self, info: WorkerInfo) -> Readiness:
        loaded, engine = self._started()
        if self._deterministic is not None:
            info.deterministic = self._deterministic
        compiled = self._compiled

        def follow_released_keys(released: KeysReleased) -> None:
            engine.on_keys_released = released
            if self._adapters is not None:  # an adapter let go is no longer held ready here
                model_id = self.settings.model_id
                self._adapters.on_let_go = lambda gone: released(
                    [(adapter_key(model_id, name), claimed_ms) for name, claimed_ms in gone]
                )

        info.speculative = "ngram" if engine.drafter is not None else "off"
        if self._adapters is not None:
            assert isinstance(loaded.model, NativeCausalLM), "adapters run on the native decoder"
            info.lora = model_shapes(loaded.model.config, self.settings.max_lora_rank)
        readiness = Readiness(
            loaded.max_model_len,
            loaded.source,
            compile_probe=(lambda: compiled.state.value) if compiled is not None else None,
            follow_released_keys=follow_released_keys,
            speculation_probe=lambda: (engine.num_draft_tokens, engine.num_accepted_tokens),
            fair_share_slots=min(self._fair_share_slots, engine.max_running - 1),
            adapters_to_store=tuple(
                (a.name, a.config, a.weights, a.adapter.rank, sorted(a.adapter.targets)) for a in self._local_adapters
            ),
        )
        if loaded.vision is None:
            return readiness
        info.vision = True
        stats = loaded.vision.stats
        return replace(
            readiness, vision_probe=lambda: (stats.images_encoded, stats.image_cache_hits, stats.encode_seconds)
        )

    def _started(self) -> tuple[LoadedModel, LLMEngine]:
        assert self._loaded is not None and self._engine is not None, "the kind has not started"
        return self._loaded, self._engine

    def _wants_compiled_step(self) -> bool:
        """The compiled one-row step, unless a setting or the machine rules it out (the plan
        then decides whether this model can have it)."""
        s = self.settings
        if s.compile_decode == "off":
            return False
        if s.deterministic == "on":
            # Alone, a row would run the compiled kernels; in a batch, the eager ones: other bits.
            logger.info("--deterministic on: one stream's decode step stays eager (not compiled)")
            return False
        if not can_compile():
            logger.info("no C++ compiler on PATH: one stream's decode step stays eager")
            return False
        return True

    def _test_determinism(self, loaded: LoadedModel) -> None:
        """Claim the deterministic promise only where the whole step keeps it on this machine:
        tested here, or passed before on the same weights, code, CPU and thread counts."""
        thread_counts = {1, len(os.sched_getaffinity(0))}
        passes = PassedSelfTests(self.settings.cache_dir)
        key = passes.key(loaded.model, thread_counts)
        earlier = passes.passed(key)
        if earlier is not None:
            logger.info("deterministic self-test passed before on these weights, this code and this CPU (%s, "
                        "%.1f s then): not run again", earlier.detail, earlier.seconds)  # fmt: skip
            self._deterministic = True
            return
        result = check_determinism(loaded.model, _decoder(loaded), loaded.eos_token_ids, thread_counts)
        if result.holds:
            logger.info("deterministic self-test passed in %.1f s (%s)", result.seconds, result.detail)
            passes.remember(key, result)
        else:
            logger.warning("--deterministic on: the self-test failed (%s), so this worker does not promise "
                           "that a request's text is the same in any batch", result.detail)  # fmt: skip
        self._deterministic = result.holds

    def _compile_decode(self, loaded: LoadedModel, engine: LLMEngine) -> None:
        """Start building (or loading) the compiled one-row step (engine thread: its thread count)."""
        s, model, cache = self.settings, loaded.model, engine.runner.cache
        assert isinstance(model, NativeCausalLM), "the plan compiles native models only"
        build_args = [
            "--model", s.model, "--cache-dir", str(s.cache_dir), "--device", "cpu", "--dtype", s.dtype,
            "--max-model-len", str(loaded.max_model_len), "--model-impl", s.model_impl,
            "--quantization", s.quantization, "--num-cache-slots", str(cache.keys[0].shape[0]),
        ]  # fmt: skip
        compiled = self._compiled = CompiledDecode(model, cache, s.cache_dir, build_args)
        engine.runner.compiled = compiled
        compiled.start(torch.get_num_threads())


def _decoder(loaded: LoadedModel) -> Decoder:
    # transformers types decode as str | list[str]: one sequence of ids decodes to one string.
    return cast(Decoder, loaded.tokenizer)


def _device(loaded: LoadedModel) -> torch.device:
    # Native and transformers models both name their device; nn.Module's typing cannot say so.
    return cast(torch.device, loaded.model.device)
