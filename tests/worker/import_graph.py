"""Who imports whom, read from the source with ``ast``: every import statement counts, those
inside functions and ``if TYPE_CHECKING:`` blocks included, because a deferred import is still a
dependency (it only hides a cycle from the interpreter, not from the reader)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ImportGraph = dict[str, set[str]]


def module_name(path: Path, package_dir: Path, package: str) -> str:
    """``package_dir/engine/sampler.py`` → ``package.engine.sampler``; a package's ``__init__.py``
    is the package itself."""
    parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path, package: str | None = None) -> ImportGraph:
    """``{module: the modules it imports}`` for every ``.py`` file under ``package_dir``, whose
    import name is ``package`` (default: the folder's name). ``from a import b`` counts as ``a.b``
    where that is a module of this package, else as ``a``; relative imports are resolved."""
    package = package or package_dir.name
    files = {module_name(path, package_dir, package): path for path in sorted(package_dir.rglob("*.py"))}
    return {module: _imports(module, path, set(files)) for module, path in files.items()}


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.module, node.level)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                imported.add(candidate if candidate in known else base)
    imported.discard(module)
    return imported


def _absolute(module: str, is_package: bool, name: str | None, level: int) -> str:
    """The absolute module of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (level - 1)]
    return ".".join([*anchor, name] if name else anchor)


def owner(module: str, folders: Iterable[str]) -> str | None:
    """The folder (a dotted package such as ``worker.engine``) that ``module`` lies in, if any."""
    return next((folder for folder in folders if module == folder or module.startswith(f"{folder}.")), None)


def folder_graph(graph: Mapping[str, set[str]], folders: Iterable[str]) -> ImportGraph:
    """The graph collapsed onto ``folders``: an edge where any module of one imports any of another."""
    folders = tuple(folders)
    edges: ImportGraph = {folder: set() for folder in folders}
    for module, imported in graph.items():
        source = owner(module, folders)
        if source is None:
            continue
        for name in imported:
            target = owner(name, folders)
            if target is not None and target != source:
                edges[source].add(target)
    return edges


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the path that closes it (``[a, b, a]``), or None if there is none."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle is not None:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None
