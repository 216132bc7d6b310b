"""One stream's decode step compiled ahead of time (AOTInductor): the package computes the eager
step's logits and writes the same keys and values, the engine uses it only where it is that step,
and a worker builds it in a background process, caches it and loads it at its next start (real
compiles of the tiny random model; ~1 min in all)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import make_stack
from tests.worker.engine_helpers import RunnerSeq
from tests.worker.test_engine import Collector
from worker.engine.builder import EngineConfig, build_engine
from worker.engine.model_runner import ModelRunner
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import PrefillChunk
from worker.engine.sequence import EngineRequest
from worker.models.loader import LoadedModel, load_model
from worker.native.compiled_decode import CompiledDecode, CompileState, build_package, can_compile, package_key
from worker.native.kv_cache import KVCacheLayout, SlotKVCache

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not can_compile(), reason="needs a C++ compiler")]
MAX_LEN = 128
SLOTS = 3


@pytest.fixture(scope="module")
def native(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    cache_dir = tmp_path_factory.mktemp("convert")
    return load_model(str(tiny_model_path), cache_dir, "cpu", "float32", MAX_LEN, "native", "none")


def _cache(loaded: LoadedModel) -> SlotKVCache:
    layout = KVCacheLayout.from_config(loaded.model.config, torch.float32, torch.device("cpu"))
    return SlotKVCache(layout, SLOTS, MAX_LEN)


@pytest.fixture(scope="module")
def package(native: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("compiled") / "step.pt2"
    build_package(native.model, _cache(native), path)  # type: ignore[arg-type]
    return path


def _ready(loaded: LoadedModel, cache: SlotKVCache, package: Path) -> CompiledDecode:
    """A CompiledDecode whose package is ``package`` (what ``start`` loads once built)."""
    compiled = CompiledDecode(loaded.model, cache, package.parent, [])  # type: ignore[arg-type]
    compiled._runner = torch._inductor.aoti_load_package(str(package))
    compiled.num_threads = torch.get_num_threads()
    compiled.state = CompileState.READY
    return compiled


def test_the_package_computes_the_eager_steps_logits_and_cache(native: LoadedModel, package: Path) -> None:
    eager = ModelRunner(native.model, _cache(native))
    compiled = ModelRunner(native.model, _cache(native))
    compiled.compiled = _ready(native, compiled.cache, package)
    prompt = [1, 17, 23, 5]
    with torch.inference_mode():
        for runner in (eager, compiled):
            runner.prefill([PrefillChunk(RunnerSeq(prompt, slot=0), 0, len(prompt))])  # type: ignore[arg-type]
        for position in range(len(prompt), 60):
            token = 7 + position % 11
            expected, got = eager.decode([token], [position]), compiled.decode([token], [position])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            assert int(got.argmax()) == int(expected.argmax())
    for layer in range(len(eager.cache.keys)):
        torch.testing.assert_close(compiled.cache.keys[layer][0, :, :60], eager.cache.keys[layer][0, :, :60])
        torch.testing.assert_close(compiled.cache.values[layer][0, :, :60], eager.cache.values[layer][0, :, :60])


def test_it_runs_only_the_step_it_was_built_for(native: LoadedModel, package: Path) -> None:
    cache = _cache(native)
    compiled = _ready(native, cache, package)
    assert compiled.runs(num_rows=1, kv_len=10)
    assert not compiled.runs(num_rows=2, kv_len=10)  # a batch: the eager forward
    assert not compiled.runs(num_rows=1, kv_len=MAX_LEN)  # past the export's dynamic range
    compiled.num_threads += 1  # OpenMP's team size is compiled in: another count runs eagerly
    assert not compiled.runs(num_rows=1, kv_len=10)
    compiled.num_threads -= 1
    compiled.state = CompileState.BUILDING
    assert not compiled.runs(num_rows=1, kv_len=10)


def test_the_engine_gives_the_same_text_with_the_compiled_step(native: LoadedModel, package: Path) -> None:
    def generate(with_package: bool) -> list[list[int]]:
        layout = KVCacheLayout.from_config(native.model.config, torch.float32, torch.device("cpu"))
        config = EngineConfig(max_num_seqs=SLOTS, max_num_batched_tokens=64, max_model_len=MAX_LEN,
                              kv_cache_bytes=(SLOTS + 1) * layout.bytes_per_token * MAX_LEN)  # fmt: skip
        engine = build_engine(native.model, native.tokenizer, config, native.eos_token_ids, Collector())
        assert tuple(engine.runner.cache.keys[0].shape) == tuple(_cache(native).keys[0].shape)
        compiled = _ready(native, engine.runner.cache, package) if with_package else None
        engine.runner.compiled = compiled
        requests = [
            EngineRequest(
                f"r{i}", [[1, 9 + i, 30 + 2 * i]], SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
            )
            for i, n in enumerate((80, 40, 40))
        ]
        engine.submit(requests[0])  # alone first: one-row steps, then a batch of three, then alone again
        for _ in range(10):
            engine.run_step()
        engine.submit(requests[1])
        engine.submit(requests[2])
        for _ in range(300):
            if all(r.is_finished for r in requests):
                break
            engine.run_step()
        if compiled is not None:
            assert compiled.num_steps >= 9 + 25  # r0's first steps alone, and its last ones
        return [r.sequences[0].output_token_ids for r in requests]

    assert generate(with_package=True) == generate(with_package=False)


def test_the_key_follows_the_weights_and_the_thread_count(native: LoadedModel) -> None:
    cache = _cache(native)
    model = native.model
    key = package_key(model, cache, 2)  # type: ignore[arg-type]
    assert package_key(model, cache, 2) == key  # type: ignore[arg-type]
    assert package_key(model, cache, 1) != key  # type: ignore[arg-type]
    weight = model.model.layers[0].mlp.down_proj.weight  # type: ignore[union-attr]
    with torch.no_grad():
        weight.view(-1)[-1] += 1.0
        try:
            assert package_key(model, cache, 2) != key  # type: ignore[arg-type]
        finally:
            weight.view(-1)[-1] -= 1.0


def test_a_failed_build_leaves_the_step_eager(native: LoadedModel, tmp_path: Path) -> None:
    compiled = CompiledDecode(native.model, _cache(native), tmp_path, ["--model", str(tmp_path / "absent")])  # type: ignore[arg-type]
    compiled.start(torch.get_num_threads())
    assert compiled.wait(120) is CompileState.FAILED
    assert not compiled.runs(num_rows=1, kv_len=10)
    assert not list((tmp_path / "compiled").glob("*.pt2"))


# -- a worker builds it in the background, then loads it from the cache ------------------------
@pytest.fixture
def stack_and_cache(redis_url: str, log_dir: Path, tmp_path: Path) -> Iterator[tuple[object, Path]]:
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        yield stack, tmp_path / "relaylm-cache"
    finally:
        stack.stop()


def _wait_compiled(stack: object, worker_index: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        info = stack.worker_info(f"{stack.key_prefix}-worker{worker_index}")  # type: ignore[attr-defined]
        if info is not None and info.compiled_decode in ("ready", "failed"):
            return str(info.compiled_decode)
        assert time.monotonic() < deadline, "the compiled step was neither ready nor failed in time"
        time.sleep(0.2)


def test_a_worker_builds_the_step_in_the_background_and_loads_it_at_its_next_start(
    stack_and_cache: tuple[object, Path], tiny_model_path: Path
) -> None:
    stack, cache_dir = stack_and_cache
    settings = {"dtype": "float32", "max_model_len": MAX_LEN, "compile_decode": "auto", "deterministic": "off",
                "cache_dir": cache_dir, "log_level": "INFO"}  # fmt: skip
    first = stack.start_worker(tiny_model_path, "compiled-tiny", **settings)  # type: ignore[attr-defined]
    # Ready (serving eagerly) before the build ends; the build then ends on its own.
    assert _wait_compiled(stack, 0, 300) == "ready", first.log()
    assert "compiled and cached" in first.log()
    reply = stack.client().chat.completions.create(  # type: ignore[attr-defined]
        model="compiled-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    first.stop()
    second = stack.start_worker(tiny_model_path, "compiled-tiny", **settings)  # type: ignore[attr-defined]
    assert _wait_compiled(stack, 1, 60) == "ready", second.log()
    assert "loaded from the cache" in second.log()
    again = stack.client().chat.completions.create(  # type: ignore[attr-defined]
        model="compiled-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0
    )
    assert again.choices[0].message.content == reply.choices[0].message.content


def test_a_build_runs_at_low_priority_and_dies_with_its_worker(tiny_model_path: Path, tmp_path: Path) -> None:
    """A stand-in worker starts a build as CompiledDecode does and is SIGKILLed: the build goes too."""
    spawn = (
        "import os, subprocess, sys, time\n"
        "command = [sys.executable, '-m', 'worker.models.compile_decode', '--model', sys.argv[1], '--cache-dir',"
        " sys.argv[2], '--dtype', 'float32', '--max-model-len', '128', '--num-cache-slots', '4', '--num-threads', '1',"
        " '--out', sys.argv[3], '--parent-pid', str(os.getpid())]\n"
        "child = subprocess.Popen(command)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    out = tmp_path / "step.pt2"
    worker = subprocess.Popen([sys.executable, "-c", spawn, str(tiny_model_path), str(tmp_path), str(out)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert worker.stdout is not None
        build = psutil.Process(int(worker.stdout.readline()))
        deadline = time.monotonic() + 60
        while build.nice() != 10:  # lowered last: its parent-death signal is set by then
            assert time.monotonic() < deadline and build.is_running()
            time.sleep(0.05)
        worker.kill()
        worker.wait()
        assert psutil.wait_procs([build], timeout=10)[1] == []
    finally:
        worker.kill()
    assert not out.exists()
