"""The deterministic promise, tested on the loaded model before a worker claims it: the whole
step (forward, sampler, scheduler, prefix cache), not one kernel.

A few greedy and seeded continuations run alone; then all of them at once with
prefill chunked, half their prompts already in the prefix cache and half new; then alone again
at one thread and at every core the worker may use (its host pool changes its thread count while
it serves); then all at once again, each drafting its own answer with every third drafted token
spoiled, so verification keeps whole drafts, parts of them and none (``drafter.py``). Every run
must give every request the same tokens. The prompts are fixed token ids,
not text: the numerics are what is tested, and any ids are valid input.

A pass is remembered under ``--cache-dir`` (``PassedSelfTests``), keyed by the weights, the
worker's code, the CPU and the thread counts: a worker restarted on the same of all of them does
not test again. A failure is not remembered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine.builder import EngineConfig, build_engine
from worker.engine.detokenizer import Decoder
from worker.engine.drafter import DraftState
from worker.engine.engine import LLMEngine, RequestOutput
from worker.engine.prefix_cache import BLOCK_SIZE
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import EngineRequest
from worker.native.fingerprint import code_digest, machine_digest, update_with_weights
from worker.native.kv_cache import KVCacheLayout
from worker.native.model_config import text_config

logger = logging.getLogger(__name__)

NEW_TOKENS = 8
MAX_LEN = 256
PROMPT_LENGTHS = (5, 40, 71, 130)  # under, at and past a prefix-cache block, and several chunks


@dataclass(frozen=True)
class SelfTestResult:
    holds: bool
    seconds: float
    detail: str  # what differed, or what was run


class _Done:
    def __init__(self) -> None:
        self.ids: set[str] = set()

    def __call__(self, outputs: list[RequestOutput]) -> None:
        self.ids.update(output.request_id for output in outputs if output.is_done)


class _SpoiledAnswers:
    """Drafts the answer a sequence gave alone (its prompt and output so far pick it), every
    third drafted token replaced by another."""

    def __init__(self, prompts: list[list[int]], answers: list[list[int]], vocab: int) -> None:
        self._answers = [(prompt, answer) for prompt, answer in zip(prompts, answers, strict=True)]
        self._vocab = vocab

    def propose(self, tokens: Seq[int], state: DraftState, limit: int) -> list[int]:
        for prompt, answer in self._answers:
            done = len(tokens) - len(prompt)
            if (
                0 <= done < len(answer)
                and list(tokens[: len(prompt)]) == prompt
                and list(tokens[len(prompt) :]) == answer[:done]
            ):
                draft = answer[done : done + min(limit, 4)]
                return [(token + 1) % self._vocab if (done + i) % 3 == 2 else token for i, token in enumerate(draft)]
        return []


def _requests(prompts: list[list[int]], tag: str) -> list[EngineRequest]:
    """Each prompt greedy and seeded (top-p and top-k truncation on the seeded ones)."""
    requests = []
    for i, prompt in enumerate(prompts):
        greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        seeded = SamplingParams(
            temperature=1.0, top_p=0.9, top_k=50, seed=1000 + i, max_new_tokens=NEW_TOKENS, ignore_eos=True
        )
        requests.append(EngineRequest(f"{tag}-g{i}", [prompt], greedy))
        requests.append(EngineRequest(f"{tag}-s{i}", [prompt], seeded))
    return requests


def _run(engine: LLMEngine, done: _Done, batches: Iterable[list[EngineRequest]]) -> list[list[int]]:
    tokens = []
    for batch in batches:
        for request in batch:
            engine.submit(request)
        steps = 0
        while not {request.request_id for request in batch} <= done.ids:
            engine.run_step()
            steps += 1
            if steps > 10_000:
                raise RuntimeError("self-test requests did not finish")
        tokens += [request.sequences[0].output_token_ids for request in batch]
    return tokens


def check_determinism(
    model: torch.nn.Module, tokenizer: Decoder, eos_token_ids: frozenset[int], thread_counts: Iterable[int]
) -> SelfTestResult:
    """Run the scenarios above on ``model``; ``thread_counts``: the counts to check besides the
    current one."""
    started = time.monotonic()
    param = next(model.parameters())
    layout = KVCacheLayout.from_config(text_config(model.config), param.dtype, param.device)
    vocab = int(getattr(model.config, "vocab_size", 1000))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(min(100, vocab - 1), vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    cached = [prompt + torch.randint(0, vocab, (BLOCK_SIZE,), generator=generator).tolist() for prompt in prompts]

    def engine(step_tokens: int, prefix_cache: bool, speculative: bool = False) -> tuple[LLMEngine, _Done]:
        config = EngineConfig(
            max_num_seqs=16,
            max_num_batched_tokens=step_tokens,
            max_model_len=MAX_LEN,
            kv_cache_bytes=18 * layout.bytes_per_token * MAX_LEN,
            prefix_cache_bytes=(64 * BLOCK_SIZE * layout.bytes_per_token) if prefix_cache else 0,
            speculative="ngram" if speculative else "off",
        )
        done = _Done()
        return build_engine(model, tokenizer, config, eos_token_ids, done), done

    threads = torch.get_num_threads()
    try:
        alone_engine, alone_done = engine(MAX_LEN, prefix_cache=False)
        alone = _run(alone_engine, alone_done, ([r] for r in _requests(prompts + cached, "alone")))
        # All at once, chunked at 48 tokens: the `cached` prompts extend prompts the cache holds.
        batch_engine, batch_done = engine(48, prefix_cache=True)
        _run(batch_engine, batch_done, [_requests(prompts, "warm")])
        together = _run(batch_engine, batch_done, [_requests(prompts + cached, "together")])
        if together != alone:
            return _result(False, started, "all at once, chunked, from the prefix cache", together, alone)
        for count in sorted(set(thread_counts) - {threads}):
            torch.set_num_threads(count)
            again = _run(alone_engine, alone_done, ([r] for r in _requests(prompts + cached, f"t{count}")))
            if again != alone:
                return _result(False, started, f"alone at {count} threads (against {threads})", again, alone)
        drafting_engine, drafting_done = engine(48, prefix_cache=False, speculative=True)
        requests = _requests(prompts + cached, "drafting")
        drafting_engine.drafter = _SpoiledAnswers([r.prompts[0] for r in requests], alone, vocab)
        drafting_engine.scheduler.max_drafting = len(requests)  # every decoding row drafts
        drafted = _run(drafting_engine, drafting_done, [requests])
        if drafted != alone:
            return _result(False, started, "all at once, verifying drafts", drafted, alone)
    finally:
        torch.set_num_threads(threads)
    return _result(
        True,
        started,
        f"{len(alone)} requests alone, together, drafting and at threads {sorted(set(thread_counts) | {threads})}",
    )


def _result(
    holds: bool,
    started: float,
    what: str,
    tokens: list[list[int]] | None = None,
    expected: list[list[int]] | None = None,
) -> SelfTestResult:
    detail = what
    if tokens is not None and expected is not None:
        differing = [i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b]
        detail = f"{what}: requests {differing} of {len(expected)} differ from their run alone"
    return SelfTestResult(holds, time.monotonic() - started, detail)


class PassedSelfTests:
    """The self-tests that passed on this machine, one small file each under ``cache_dir``."""

    def __init__(self, cache_dir: Path) -> None:
        self._dir = cache_dir / "self-test"

    @staticmethod
    def key(model: torch.nn.Module, thread_counts: Iterable[int]) -> str:
        """What a pass depends on: the weights, the worker's code (this test's included), the
        CPU, torch and the thread counts tested (the current one among them)."""
        counts = sorted(set(thread_counts) | {torch.get_num_threads()})
        digest = hashlib.blake2b(digest_size=16)
        update_with_weights(digest, model)
        digest.update(f"{code_digest()}:{machine_digest()}:{counts}".encode())
        return f"exact-{digest.hexdigest()}"

    def passed(self, key: str) -> SelfTestResult | None:
        """The remembered pass under ``key``, or None where there is none (or it cannot be read)."""
        try:
            record = json.loads((self._dir / f"{key}.json").read_text())
            return SelfTestResult(True, float(record["seconds"]), str(record["detail"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remember(self, key: str, result: SelfTestResult) -> None:
        """Keep a pass (written whole, then renamed into place); a cache that cannot be written
        only means the next start tests again."""
        if not result.holds:
            return
        path = self._dir / f"{key}.json"
        partial = path.with_suffix(f".{os.getpid()}.partial")
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"seconds": result.seconds, "detail": result.detail}))
            partial.replace(path)
        except OSError as exc:
            logger.warning("the passed self-test was not cached (%s): the next start tests again", exc)
