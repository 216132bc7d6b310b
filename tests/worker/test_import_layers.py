"""The worker's packages import one way: the model's numerics (``native``) know nothing of the
engine that drives them, and no two of the engine's neighbours import each other in a circle."""

from __future__ import annotations

from pathlib import Path

from tests.worker.import_graph import find_cycle, folder_graph, import_graph

WORKER_DIR = Path(__file__).resolve().parents[2] / "worker"
LAYERED = ("worker.engine", "worker.native", "worker.parsers", "worker.structured", "worker.embedding")


def test_native_does_not_import_the_engine() -> None:
    graph = import_graph(WORKER_DIR)
    offenders = {
        module: sorted(name for name in imported if name == "worker.engine" or name.startswith("worker.engine."))
        for module, imported in graph.items()
        if module.startswith("worker.native.")
    }
    assert {module: names for module, names in offenders.items() if names} == {}


def test_no_cycle_between_the_engine_and_its_neighbours() -> None:
    edges = folder_graph(import_graph(WORKER_DIR), LAYERED)
    assert edges["worker.engine"] >= {"worker.native"}  # the graph sees real imports
    assert find_cycle(edges) is None


def test_the_graph_counts_deferred_and_relative_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.sub import b\n"
        "def f() -> None:\n    import json\n    from .sub.b import thing\n"
    )
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("from .. import a\nfrom ..a import f\n")
    assert import_graph(package) == {
        "pkg": {"pkg.a"},
        "pkg.a": {"typing", "pkg.sub.b", "json"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a"},
    }


def test_a_cycle_is_found_through_a_third_folder() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
