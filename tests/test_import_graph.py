"""The import graph of ``kvloom`` and ``kvloom_registry`` has no cycle, and the registry
never imports ``kvloom``.

The graph is read from the source with ``ast``: module-level imports and imports inside
functions both count (a function-level import that closes a loop is still a loop, only
a later one); imports under ``if TYPE_CHECKING:`` do not (they never run). Importing
``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``, so an import depends on those
packages too, except on the importer's own packages: those are initialised before it, and
a package ``__init__`` that re-exports its own modules is no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvloom": ROOT / "core" / "kvloom", "kvloom_registry": ROOT / "registry" / "kvloom_registry"}


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            found[_module_name(package, root, path)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every module name an import statement of ``tree`` may load, outside TYPE_CHECKING."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.append(target)
            names.extend(f"{target}.{alias.name}" for alias in node.names)  # submodules
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for imported in _imported_names(tree, name, path.name == "__init__.py"):
            parts = imported.split(".")
            # the module itself and every package it runs on the way
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in modules and candidate not in own_packages:
                    edges.add(candidate)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_is_read(graph: dict[str, set[str]]) -> None:
    # A reader that finds no edges would pass every check below.
    assert "kvloom.engine.core" in graph and "kvloom_registry.loader" in graph
    assert "kvloom.scheduler.scheduler" in graph["kvloom.engine.core"]
    assert sum(len(e) for e in graph.values()) > 200


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles (counting imports inside functions):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_registry_never_imports_kvloom(graph: dict[str, set[str]]) -> None:
    back = sorted(
        f"{m} -> {d}" for m, deps in graph.items() if m.startswith("kvloom_registry") for d in deps
        if d == "kvloom" or d.startswith("kvloom.")
    )
    assert not back, "the registry must know nothing of the engine:\n" + "\n".join(back)


def test_cycle_finder_finds_a_cycle() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
