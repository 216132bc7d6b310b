"""The import structure, read from the source: the API and the workers share only ``shared/``
(the contract, events, keys, lifecycle), no wire model reaches a worker, and neither modules nor
folders import each other in a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "worker", "shared", "relaylm")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (``a.b.C`` → ``a.b`` when ``C`` is not a module)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """Every project module ``module`` imports: at the top, inside functions, under TYPE_CHECKING."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            resolved = _resolve(name)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _folder(module: str) -> str:
    """A module's folder (``worker.engine``); a module at the top of a package (``api.app``,
    ``worker.settings``) stands for itself, since the package's top holds both the modules its
    folders build on and the one that assembles them."""
    path = MODULES[module]
    folder = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return module if folder in PACKAGES else folder


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _importers(prefix: str, of: Iterable[str]) -> dict[str, list[str]]:
    targets = tuple(of)
    return {
        module: sorted(t for t in imported if t.startswith(targets))
        for module, imported in GRAPH.items()
        if module.startswith(prefix) and any(t.startswith(targets) for t in imported)
    }


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(GRAPH) == []


def test_no_folder_imports_itself_through_others() -> None:
    folders: dict[str, set[str]] = {}
    for module, imported in GRAPH.items():
        folders.setdefault(_folder(module), set()).update(
            _folder(target) for target in imported if _folder(target) != _folder(module)
        )
    assert _cycles(folders) == []


@pytest.mark.parametrize(("side", "other"), [("api", "worker."), ("worker", "api."), ("shared", ("api.", "worker."))])
def test_api_and_workers_share_only_shared(side: str, other: str | tuple[str, ...]) -> None:
    """The worker never sees a wire model (they live in ``api.wire``); ``shared`` depends on neither side."""
    targets = (other,) if isinstance(other, str) else other
    assert _importers(f"{side}.", targets) == {}
    assert _importers(f"{side}.", ("api.wire",) if side != "api" else ()) == {}


def test_the_contract_is_what_crosses() -> None:
    """Both sides read the job through ``shared.contract``; no process-private schema is shared."""
    worker_shared = {
        t for m, imported in GRAPH.items() if m.startswith("worker.") for t in imported if t.startswith("shared.")
    }
    api_shared = {
        t for m, imported in GRAPH.items() if m.startswith("api.") for t in imported if t.startswith("shared.")
    }
    assert "shared.contract" in worker_shared and "shared.contract" in api_shared
    # Everything in shared/ is used by a process on each side of the queue, or by the command that starts both.
    users = {
        t for m, imported in GRAPH.items() if not m.startswith("shared.") for t in imported if t.startswith("shared.")
    }
    # A package's modules are reached through the package (shared.contract, shared.redis).
    reached = {
        m for m in MODULES if m.rpartition(".")[0] in users and m.startswith(("shared.contract.", "shared.redis."))
    }
    assert users | reached | {"shared"} >= {m for m in MODULES if m.startswith("shared")}


# -- one owner per job-housekeeping rule ----------------------------------------------------------


def _calls(module: str) -> list[tuple[str, str]]:
    """(receiver, attribute) of every method call in ``module``, e.g. ("self._lifecycle", "cancel")."""
    tree = ast.parse(MODULES[module].read_text())
    return [
        (ast.unparse(node.func.value), node.func.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    ]


def _modules_calling(attribute: str, receiver_hint: str) -> set[str]:
    return {
        module
        for module in MODULES
        for receiver, called in _calls(module)
        if called == attribute and receiver_hint in receiver.lower()
    }


def _modules_naming(name: str) -> set[str]:
    """Modules whose source defines or uses ``name`` (a class, a function, a name or an attribute)."""
    found = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                (isinstance(node, ast.Name) and node.id == name)
                or (isinstance(node, ast.Attribute) and node.attr == name)
                or (isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name)
            ):
                found.add(module)
                break
    return found


def test_the_orphan_policy_is_decided_in_one_module() -> None:
    """Requeue-or-fail for a job whose worker is gone: one function, used by streams and the housekeeper."""
    assert _modules_calling("reclaim", "lifecycle") == {"api.jobs.orphans"}
    assert {m for m in _modules_naming("Orphans") if m.startswith("api.")} == {
        "api.jobs.orphans", "api.jobs.housekeeping", "api.jobs.stream"
    }  # fmt: skip


def test_housekeeping_is_started_by_the_app_not_by_a_feature() -> None:
    assert {m for m in _modules_naming("Housekeeper")} == {"api.jobs.housekeeping", "api.app"}
    assert not GRAPH["api.batches.runner"] & {
        "api.jobs.housekeeping",
        "api.jobs.orphans",
        "api.jobs.results",
    }


def test_jobs_start_through_one_client_and_end_in_one_result_store() -> None:
    """Every job is created by ``JobClient``, which checks for a live worker once; the other
    checks are of what a request needs before its job exists (the model takes images, it
    transcribes), or before a LoRA adapter is stored (its base model is served). Background
    results are kept and read by ``ResultStore`` alone."""
    assert {m for m in _modules_calling("create", "lifecycle") if m.startswith("api.")} == {"api.jobs.client"}
    assert _modules_calling("require_worker", "directory") == {
        "api.jobs.client", "api.images.request", "api.routes.audio", "api.routes.adapters"
    }  # fmt: skip
    assert {m for m in _modules_naming("ended_job") if m.startswith(("api.", "shared."))} == {
        "api.jobs.results", "shared.job_lifecycle", "shared.redis_keys"
    }  # fmt: skip
    assert {m for m in _modules_calling("untrack_background", "lifecycle")} == {"api.jobs.results"}


def test_placement_is_decided_in_the_create_and_claim_scripts() -> None:
    """No router: the API names a job's prefix keys, the lifecycle's scripts decide who takes it,
    and a worker's engine says which of the keys it claimed it still holds."""
    assert {m for m in _modules_naming("prefix_keys") if not m.startswith("tests.")} == {
        "shared.placement", "shared.job_lifecycle", "api.jobs.client",  # named, decided
        "worker.kinds.generate", "worker.engine.sequence", "worker.engine.held_prefixes",  # held
    }  # fmt: skip
    assert {m for m in MODULES if "preferred_until" in MODULES[m].read_text()} == {"shared.job_lifecycle"}
    held_set = {m for m in MODULES if ":held" in MODULES[m].read_text() and not m.startswith("tests.")}
    assert held_set == {"shared.job_lifecycle", "shared.redis_keys"}


def test_job_state_changes_go_through_the_lifecycle() -> None:
    """Cancelling, the background set and the cancel channel: only ``JobLifecycle`` touches them."""
    for key in ("background_jobs", "cancel_channel"):
        assert {m for m in _modules_naming(key) if not m.startswith("worker.")} <= {
            "shared.job_lifecycle",
            "shared.redis_keys",
        }
    cancels = {m for m in _modules_calling("cancel", "lifecycle")}
    assert cancels and all(m.startswith("api.") for m in cancels)
    assert _modules_calling("end", "lifecycle") <= {"api.jobs.orphans", "shared.job_lifecycle"}


def test_the_reading_sees_deferred_and_typing_only_imports() -> None:
    """Imports inside functions and under TYPE_CHECKING count: they are dependencies too."""
    assert "worker.native.compiled_decode" in GRAPH["worker.engine.model_runner"]  # under TYPE_CHECKING
    assert "worker.service.main" in GRAPH["relaylm.cli"]  # inside the function that starts a worker


def test_the_numerics_know_nothing_of_the_engine() -> None:
    """``native`` (the forward pass, kernels, KV storage) is driven by ``engine`` and never calls back."""
    assert _importers("worker.native.", ("worker.engine",)) == {}
    assert _importers("worker.parsers.", ("worker.engine",)) == {}
    assert _importers("worker.structured.", ("worker.engine",)) == {}


# -- one place per decision -----------------------------------------------------------------------

_TASKS = {"generate", "embed", "transcribe"}


def _compares_a_task(module: str) -> bool:
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in _TASKS for o in operands):
                return True
    return False


def test_worker_tasks_are_dispatched_in_one_place() -> None:
    """``worker.kinds`` picks the kind for the task; the process, runner and engine thread see
    only the kind's protocols, never a model, engine or handler of one task."""
    kinds = ("worker.kinds.generate", "worker.kinds.embed", "worker.kinds.transcribe")
    assert {m for m in _importers("worker.", kinds) if not m.startswith(kinds)} == {"worker.kinds"}
    assert {m for m in MODULES if m.startswith("worker.") and _compares_a_task(m)} == {"worker.kinds"}
    task_specific = ("worker.audio", "worker.embedding", "worker.models", "worker.native", "worker.requests")
    assert _importers("worker.service.", task_specific) == {}


def _reads_app_state(module: str) -> bool:
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "state" and ast.unparse(node.value).endswith("app"):
            return True
    return False


def test_app_state_is_read_only_by_the_wiring() -> None:
    """Routes and helpers reach the API's services through ``api.services``, typed."""
    assert {m for m in MODULES if m.startswith("api.") and _reads_app_state(m)} == {"api.app", "api.services"}


_SETTING_HOLDERS = {"s", "settings", "self.settings", "info"}


def _variant_reads(module: str) -> set[str]:
    """Where ``module`` decides an engine variant itself: the exact numerics sniffed from a model,
    or the memory's layout from the device."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called == "getattr" and any(
                isinstance(a, ast.Constant) and a.value == "deterministic" for a in node.args
            ):
                found.add("getattr(deterministic)")
            if called.endswith("is_lazily_backed"):
                found.add("is_lazily_backed()")
        # Not the setting (s, settings) or the registry record (info): a model's own word.
        holder = ast.unparse(node.value) if isinstance(node, ast.Attribute) else ""
        if isinstance(node, ast.Attribute) and node.attr == "deterministic" and holder not in _SETTING_HOLDERS:
            found.add(".deterministic")
    return found


def test_engine_variants_are_read_from_the_execution_plan() -> None:
    """The engine, scheduler, sampler and the worker's kind read the plan; only the plan, the
    loader (which makes the exact model) and the KV cache (which maps its own memory) look."""
    readers = {m: reads for m in MODULES if m.startswith("worker.") and (reads := _variant_reads(m))}
    assert readers == {
        "worker.engine.plan": {".deterministic", "is_lazily_backed()"},
        "worker.models.loader": {".deterministic"},
        "worker.native.kv_cache": {"is_lazily_backed()"},
    }


def test_the_prefix_policy_is_chosen_once() -> None:
    """The builder picks the plan's prefix policy; the scheduler and engine call its interface
    (``worker.engine.prefixes``) and know no implementation."""
    policies = ("worker.engine.shared_prefix", "worker.engine.prefix_cache")
    users = {m for m in _importers("worker.", policies) if m not in policies}
    assert users - {"worker.engine.builder"} <= {"worker.engine.prefixes", "worker.engine.self_test"}
    assert "worker.engine.prefixes" in imports_of("worker.engine.scheduler")
