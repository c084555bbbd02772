"""The import graph of ``kvloom``, ``kvloom_registry`` and the plugin distributions' packages
has no cycle, the registry never imports ``kvloom``, and the plugin face loads no part of
the worker or the engine.

The graph is read from the source with ``ast``: module-level imports and imports inside
functions both count (a function-level import that closes a loop is still a loop, only
a later one). Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``, so an
import depends on those packages too, except on the importer's own packages: those are
initialised before it, and a package ``__init__`` that re-exports its own modules is no
cycle. Three graphs are read:

- the run-time graph: imports under ``if TYPE_CHECKING:`` do not count (they never run);
  it has no cycle at all;
- the type graph: they count too (a reader, or a type checker, follows them); its one cycle
  is the config ring (``CONFIG_RING``, also in docs/architecture.md);
- the eager graph: only what runs when a module is imported (no function bodies, no
  ``TYPE_CHECKING``): what ``import kvloom.interfaces`` loads.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: kvloom, the registry and every plugin distribution's package (``backends/flashinfer/kvloom_backend_flashinfer``).
PACKAGES = {
    "kvloom": ROOT / "core" / "kvloom",
    "kvloom_registry": ROOT / "registry" / "kvloom_registry",
    **{
        package.name: package
        for pattern in ("backends/*/kvloom_*", "platforms/*/kvloom_*", "plugins/*/kvloom_*",
                        "plugins/examples/*/kvloom_*", "tests/plugins/*/kvloom_*")
        for package in sorted(ROOT.glob(pattern))
        if (package / "__init__.py").is_file()
    },
}  # fmt: skip


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


def _imported_names(tree: ast.AST, module: str, is_package: bool, *, type_checking: bool, eager: bool) -> list[str]:
    """Every module name an import statement of ``tree`` may load: with ``type_checking``,
    also those under ``if TYPE_CHECKING:``; with ``eager``, only those that run when the
    module is imported (not inside functions)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if eager and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
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


def import_graph(*, type_checking: bool = False, eager: bool = False) -> dict[str, set[str]]:
    """Module -> the modules its imports load (see ``_imported_names`` for the two switches)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        imported = _imported_names(tree, name, path.name == "__init__.py", type_checking=type_checking, eager=eager)
        for target in imported:
            parts = target.split(".")
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


#: The one cycle of the type graph, and why it stays: pydantic validates the config's
#: ``type[AttentionBackend]`` and ``type[Platform]`` fields at run time, so the config imports
#: the contracts, and the contracts name ``EngineConfig`` in their signatures (type-only).
#: The quantization contract is a config field too (``ModelConfig.quantization``), and names
#: the layers it quantizes. The other members are on the way: ``ModelConfig.mla_dims``
#: builds an ``MLADims`` (``attention.mla_backend``), ``parallel_state`` names ``Platform``,
#: and ``Platform.get_worker_cls`` names ``WorkerBase`` (``platforms.worker``).
CONFIG_RING = frozenset({
    "kvloom.config", "kvloom.attention.backend", "kvloom.attention.mla_backend", "kvloom.platforms",
    "kvloom.platforms.interface", "kvloom.platforms.worker", "kvloom.distributed.parallel_state",
    "kvloom.layers", "kvloom.layers.fused_moe", "kvloom.layers.linear", "kvloom.layers.vocab_embedding",
    "kvloom.quantization.context", "kvloom.quantization.layer_methods", "kvloom.quantization.method",
})  # fmt: skip
#: What makes the ring a ring: without these, CONFIG_RING lists a cycle that is not there.
CONFIG_RING_CORE = frozenset({"kvloom.config", "kvloom.attention.backend", "kvloom.platforms.interface"})
#: The model runner and its CUDA-graph runner, which once named each other.
RUNNER_KNOT = frozenset({"kvloom.worker.model_runner", "kvloom.worker.cudagraph"})
#: The plugin face, and what it must not load.
FACE = ("kvloom.interfaces", "kvloom.interfaces.models")
NOT_IN_FACE = ("kvloom.worker", "kvloom.engine")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


@pytest.fixture(scope="module")
def type_graph() -> dict[str, set[str]]:
    return import_graph(type_checking=True)


def _reachable(graph: dict[str, set[str]], starts: Sequence[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def _in_face_forbidden(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in NOT_IN_FACE)


def test_the_graph_is_read(graph: dict[str, set[str]], type_graph: dict[str, set[str]]) -> None:
    # A reader that finds no edges would pass every check below.
    assert "kvloom.engine.core" in graph and "kvloom_registry.loader" in graph
    assert "kvloom.scheduler.scheduler" in graph["kvloom.engine.core"]
    assert sum(len(e) for e in graph.values()) > 200
    assert "kvloom_backend_flashinfer.mla" in graph and "kvloom_platform_cpu_threads.worker" in graph
    # stats.py names EngineCoreOutput under TYPE_CHECKING only
    assert "kvloom.outputs" in type_graph["kvloom.metrics.stats"] - graph["kvloom.metrics.stats"]
    assert graph.keys() == type_graph.keys() and all(graph[m] <= type_graph[m] for m in graph)


def test_the_reader_sees_each_kind_of_import(tmp_path: Path) -> None:
    tree = ast.parse(
        "import a\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
        "def f():\n    import d\n"
        "class K:\n    import e\n"
    )
    read = lambda **kw: set(_imported_names(tree, "m", False, **kw)) - {"typing", "typing.TYPE_CHECKING"}
    assert read(type_checking=False, eager=False) == {"a", "c", "d", "e"}
    assert read(type_checking=True, eager=False) == {"a", "b", "c", "d", "e"}
    assert read(type_checking=False, eager=True) == {"a", "c", "e"}


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles (counting imports inside functions):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_type_level_cycle_but_the_config_ring(type_graph: dict[str, set[str]]) -> None:
    components = [set(c) for c in strongly_connected(type_graph)]
    others = [c for c in components if not c <= CONFIG_RING]
    assert not others, "import cycles counting TYPE_CHECKING imports (name a leaf module both sides can import):\n" + (
        "\n".join(" <-> ".join(sorted(c)) for c in others)
    )
    assert any(CONFIG_RING_CORE <= c for c in components), "the config ring is gone: update CONFIG_RING and docs"


def test_the_runner_knot_is_open(type_graph: dict[str, set[str]]) -> None:
    knots = [c for c in strongly_connected(type_graph) if RUNNER_KNOT & set(c)]
    assert not knots, knots


def test_the_face_loads_no_worker_or_engine_module_but_one_deprecated_alias() -> None:
    """``import kvloom.interfaces`` loads no ``kvloom.worker`` or ``kvloom.engine`` module; the
    face may reach one (the model runner class) lazily, from the ``__getattr__`` of its one
    deprecated alias, only when a plugin still uses the old name (or, after a major version,
    not at all)."""
    import kvloom.interfaces

    eager, full = import_graph(eager=True), import_graph()
    loaded = sorted(m for m in _reachable(eager, FACE) if _in_face_forbidden(m))
    assert not loaded, f"importing the face loads {loaded}"
    reached = {m for face in FACE for m in full[face] - eager[face] if _in_face_forbidden(m)}
    # One module counts once: importing kvloom.worker.model_runner also runs kvloom.worker.
    lazy = sorted(m for m in reached if not any(other.startswith(m + ".") for other in reached))
    aliases = getattr(vars(kvloom.interfaces).get("__getattr__"), "deprecations", {})
    assert len(lazy) <= 1, f"the face reaches {lazy} lazily: one deprecated alias at most"
    assert not lazy or len(aliases) == 1, f"the face reaches {lazy} lazily, but its deprecated aliases are {aliases}"


def test_registry_never_imports_kvloom(graph: dict[str, set[str]]) -> None:
    back = sorted(
        f"{m} -> {d}" for m, deps in graph.items() if m.startswith("kvloom_registry") for d in deps
        if d == "kvloom" or d.startswith("kvloom.")
    )
    assert not back, "the registry must know nothing of the engine:\n" + "\n".join(back)


def test_cycle_finder_finds_a_cycle() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
