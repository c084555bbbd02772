"""Plugins use kvloom's public face only: a plugin written from the docs alone can do
everything the first-party ones do.

Every ``.py`` file of the plugin distributions (``backends/*``, ``platforms/*``,
``plugins/*``, ``tests/plugins/*``) is read with ``ast``, and every use of a ``kvloom``
module is collected: import statements at module level, inside functions and under
``if TYPE_CHECKING:`` alike (``from kvloom import plugins`` is the module
``kvloom.plugins``); attributes reached through an imported ``kvloom``
(``import kvloom`` then ``kvloom.plugins.x``); ``importlib.import_module("kvloom.x")``;
lazy ``"kvloom.x:Name"`` targets (as ``ModelRegistry.register_model`` takes them);
``python -m kvloom.x`` command lines; and import statements inside string literals (code
run by ``python -c``). The rule:

- package code (the importable plugin packages) uses ``kvloom.interfaces`` and
  ``kvloom.interfaces.models`` only;
- test code (a distribution's ``tests/`` folder) uses those, ``kvloom.testing`` and its
  modules, and ``kvloom`` itself for its user API (``from kvloom import LLM,
  SamplingParams, EngineArgs``; ``python -m kvloom``);
- the example packages (``plugins/examples/*``), which third parties copy, import nothing
  of this repository but kvloom: not kvloom's own test helpers (``tests.helpers``), which
  are not installed with kvloom (the first-party distributions' tests may use them).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvloom

ROOT = Path(__file__).resolve().parents[1]
KVLOOM_SRC = ROOT / "core" / "kvloom"
DISTRIBUTION_GLOBS = ("backends/*", "platforms/*", "plugins/*", "plugins/examples/*", "tests/plugins/*")
#: What ``from kvloom import NAME`` may name: the user API (everything else is a module).
USER_API = frozenset(kvloom.__all__)

PACKAGE_ALLOWED = ("kvloom.interfaces", "kvloom.interfaces.models")


def allowed_in_package(module: str) -> bool:
    return module in PACKAGE_ALLOWED


def allowed_in_tests(module: str) -> bool:
    return (
        module == "kvloom"
        or module in PACKAGE_ALLOWED
        or module == "kvloom.testing"
        or module.startswith("kvloom.testing.")
    )


@dataclass(frozen=True)
class Use:
    path: Path
    line: int
    module: str  # "kvloom" or "kvloom.<x>"
    how: str = ""  # "" for an import statement, else what kind of use

    def format(self) -> str:
        where = f" ({self.how})" if self.how else ""
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.module}{where}"


def _is_kvloom(module: str) -> bool:
    return module == "kvloom" or module.startswith("kvloom.")


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` (``kvloom.<...>``) is a module or package of kvloom's source."""
    path = KVLOOM_SRC.joinpath(*dotted.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _from_import(module: str, names: list[str]) -> list[str]:
    """The kvloom modules ``from module import names`` uses: ``module.name`` where that is
    a module, else ``module`` (``from kvloom import X`` outside the user API counts as
    ``kvloom.X``: kvloom has no other public top-level name)."""
    used = []
    for name in names:
        if name != "*" and _is_module(f"{module}.{name}"):
            used.append(f"{module}.{name}")
        elif module == "kvloom" and name not in USER_API:
            used.append(f"kvloom.{name}")
        else:
            used.append(module)
    return used


_LAZY_TARGET = re.compile(r"(kvloom(?:\.\w+)*):[\w.]+")
_CODE_IMPORT = re.compile(
    r"(?:^|[;\n])[ \t]*(?:from[ \t]+(kvloom(?:\.\w+)*)[ \t]+import[ \t]+\(?([\w \t,*]+)|import[ \t]+(kvloom(?:\.\w+)*))"
)


def _imports_in_code_text(text: str) -> list[str]:
    used = []
    for match in _CODE_IMPORT.finditer(text):
        if match.group(1):
            names = [n.strip().split()[0] for n in match.group(2).split(",") if n.strip()]
            used.extend(_from_import(match.group(1), names))
        else:
            used.append(match.group(3))
    return used


def _string_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # an f-string: its literal parts, placeholders as "_"
        return "".join(v.value if isinstance(v, ast.Constant) else "_" for v in node.values)
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (prose, not code that runs)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    """``["kvloom", "a", "b"]`` for ``kvloom.a.b``; None when the chain starts elsewhere."""
    parts = []
    current: ast.AST = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if not (isinstance(current, ast.Name) and current.id == "kvloom"):
        return None
    return ["kvloom", *reversed(parts)]


def _attribute_module(chain: list[str]) -> str:
    """The module ``kvloom.a.b.c`` reaches: its longest module prefix, or ``kvloom.a``
    when ``a`` is neither a module nor part of the user API."""
    for end in range(len(chain), 1, -1):
        if _is_module(".".join(chain[:end])):
            return ".".join(chain[:end])
    return "kvloom" if chain[1] in USER_API else f"kvloom.{chain[1]}"


def kvloom_uses(path: Path) -> list[Use]:
    tree = ast.parse(path.read_text(), filename=str(path))
    # Docstrings are prose; an f-string's literal parts are read with the f-string.
    skip = _docstrings(tree) | {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    # `import kvloom` / `import kvloom.x` (without `as`) binds the name kvloom.
    binds_kvloom = any(
        isinstance(n, ast.Import) and any(a.asname is None and _is_kvloom(a.name) for a in n.names)
        for n in ast.walk(tree)
    )
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # only whole chains
    uses: list[Use] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [Use(path, node.lineno, a.name) for a in node.names if _is_kvloom(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _is_kvloom(node.module):
                names = [a.name for a in node.names]
                uses += [Use(path, node.lineno, m) for m in _from_import(node.module, names)]
        elif isinstance(node, ast.Attribute):
            if binds_kvloom and id(node) not in inner and (chain := _attribute_chain(node)) is not None:
                uses.append(Use(path, node.lineno, _attribute_module(chain), "attribute"))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and node.args:
                target = _string_text(node.args[0])
                if target is not None and _is_kvloom(target):
                    uses.append(Use(path, node.lineno, target, "import_module"))
        elif isinstance(node, (ast.List, ast.Tuple)):
            items = [_string_text(e) for e in node.elts]
            for flag, target in zip(items, items[1:]):
                if flag == "-m" and target is not None and _is_kvloom(target):
                    uses.append(Use(path, node.lineno, target, "python -m"))
        elif id(node) not in skip and (text := _string_text(node)) is not None:
            if target := _LAZY_TARGET.fullmatch(text):
                uses.append(Use(path, node.lineno, target.group(1), "lazy target"))
            uses += [Use(path, node.lineno, m, "in code run from a string") for m in _imports_in_code_text(text)]
    return sorted(set(uses), key=lambda u: (u.line, u.module, u.how))


def distribution_files() -> dict[Path, list[Path]]:
    """Each plugin distribution's folder -> its ``.py`` files."""
    found = {}
    for pattern in DISTRIBUTION_GLOBS:
        for dist in sorted(ROOT.glob(pattern)):
            if (dist / "pyproject.toml").is_file():
                found[dist] = sorted(p for p in dist.rglob("*.py") if "build" not in p.relative_to(dist).parts)
    return found


def in_tests_folder(dist: Path, path: Path) -> bool:
    return path.relative_to(dist).parts[0] == "tests"


#: Top-level packages of this repository that are not installed with kvloom.
REPO_PRIVATE_PACKAGES = ("tests",)


def repo_private_imports(path: Path) -> list[str]:
    """``file:line imports MODULE`` for every import of a repository-private package
    (``tests.helpers...``) in ``path``: import statements anywhere, and import statements
    inside string literals (code run by ``python -c``)."""

    def private(module: str) -> bool:
        return module.split(".")[0] in REPO_PRIVATE_PACKAGES

    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif (text := _string_text(node)) is not None:
            modules = re.findall(r"(?:^|[;\n])[ \t]*(?:from|import)[ \t]+([\w.]+)", text)
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        found += [f"{where}:{node.lineno} imports {m}" for m in modules if private(m)]
    return found


def example_files() -> list[Path]:
    return [p for dist, files in distribution_files().items() if dist.parent.name == "examples" for p in files]


@pytest.fixture(scope="module")
def uses() -> dict[str, list[Use]]:
    """``"package"`` / ``"tests"`` -> every kvloom use in that kind of code."""
    found: dict[str, list[Use]] = {"package": [], "tests": []}
    for dist, files in distribution_files().items():
        for path in files:
            found["tests" if in_tests_folder(dist, path) else "package"] += kvloom_uses(path)
    return found


def test_the_walk_finds_the_distributions_and_their_imports(uses: dict[str, list[Use]]) -> None:
    # A walk that finds nothing would pass every check below.
    dists = distribution_files()
    names = {str(d.relative_to(ROOT)) for d in dists}
    assert {"backends/cpu", "backends/triton", "platforms/cpu", "platforms/cuda", "plugins/gemma",
            "plugins/examples/attention_backend", "tests/plugins/dup_backend"} <= names  # fmt: skip
    assert all(dists.values()), [str(d) for d, files in dists.items() if not files]
    package = {u.module for u in uses["package"]}
    assert package >= {"kvloom.interfaces", "kvloom.interfaces.models"}
    assert len(uses["package"]) > 30
    tests = {u.module for u in uses["tests"]}
    assert {"kvloom", "kvloom.interfaces", "kvloom.testing"} <= tests
    assert len(uses["tests"]) > 20


def test_package_code_imports_only_the_interfaces(uses: dict[str, list[Use]]) -> None:
    wrong = [u.format() for u in uses["package"] if not allowed_in_package(u.module)]
    assert not wrong, (
        "plugin packages may import kvloom.interfaces and kvloom.interfaces.models only "
        "(add what plugins need there):\n" + "\n".join(wrong)
    )


def test_plugin_tests_import_only_the_public_face(uses: dict[str, list[Use]]) -> None:
    wrong = [u.format() for u in uses["tests"] if not allowed_in_tests(u.module)]
    assert not wrong, (
        "plugin tests may import kvloom (its user API), kvloom.interfaces(.models) and "
        "kvloom.testing(.*) only (add a helper to kvloom.testing for what they need):\n" + "\n".join(wrong)
    )


def test_the_examples_need_nothing_but_kvloom() -> None:
    files = example_files()
    assert len({p.parts[-3] for p in files if p.parent.name == "tests"}) >= 6  # every example's tests
    wrong = [line for path in files for line in repo_private_imports(path)]
    assert not wrong, (
        "the example packages are copied by plugin authors, who have kvloom but not this repository: "
        "use kvloom.testing (add a helper there) instead of:\n" + "\n".join(wrong)
    )


def test_the_private_import_reader(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import tests.helpers.model_fixtures\n"
        "from tests.helpers.plugin_server import REPO\n"
        "from kvloom.testing.models import tiny_model_dir\n"
        "CODE = 'import json; from tests.helpers.lora_fixtures import make_adapter'\n"
        "import testsuite\n"
    )
    found = [line.split(" imports ")[1] for line in repo_private_imports(source)]
    assert found == ["tests.helpers.model_fixtures", "tests.helpers.plugin_server", "tests.helpers.lora_fixtures"]


def test_the_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        '"""from kvloom.engine import prose"""\n'
        "from typing import TYPE_CHECKING\n"
        "import kvloom.plugins\n"
        "from kvloom import LLM, plugins\n"
        "from kvloom.attention import selector\n"
        "from kvloom.interfaces import Platform\n"
        "if TYPE_CHECKING:\n"
        "    from kvloom.config import EngineConfig\n"
        "def f():\n"
        "    from kvloom.worker.model_runner import ModelRunner\n"
        "    importlib.import_module('kvloom.lora.ops')\n"
        "    code = f'from kvloom.engine.arg_utils import EngineArgs; x = {1}'\n"
        "    cmd = [sys.executable, '-m', 'kvloom.entrypoints.cli.main']\n"
        "    logger = 'kvloom.engine.arg_utils'\n"
        "    registry.register_model('X', 'kvloom.models.llama:LlamaForCausalLM')\n"
        "    kvloom.plugins.reset_for_tests()\n"
        "    kvloom.interfaces.models.Attention\n"
        "    kvloom.LLM\n"
    )
    found = [(u.line, u.module) for u in kvloom_uses(source)]
    assert found == [
        (3, "kvloom.plugins"), (4, "kvloom"), (4, "kvloom.plugins"), (5, "kvloom.attention.selector"),
        (6, "kvloom.interfaces"), (8, "kvloom.config"), (10, "kvloom.worker.model_runner"), (11, "kvloom.lora.ops"),
        (12, "kvloom.engine.arg_utils"), (13, "kvloom.entrypoints.cli.main"), (15, "kvloom.models.llama"),
        (16, "kvloom.plugins"), (17, "kvloom.interfaces.models"), (18, "kvloom"),
    ]  # fmt: skip
    assert not allowed_in_package("kvloom") and not allowed_in_package("kvloom.testing")
    assert allowed_in_tests("kvloom.testing.reference") and not allowed_in_tests("kvloom.testingx")


def test_the_user_api_tests_may_import_is_whole() -> None:
    # Tests may use `from kvloom import NAME` for every NAME of kvloom.__all__.
    missing = []
    for name in sorted(USER_API):
        try:
            getattr(kvloom, name)
        except (AttributeError, ImportError) as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, "\n".join(missing)


def test_the_interfaces_do_not_define_the_plugins_api_declaration() -> None:
    # A plugin declares the plugin API version it was written for as a literal of its
    # own; `from kvloom.interfaces import *` must not hand it ours.
    namespace: dict[str, object] = {}
    exec("from kvloom.interfaces import *", namespace)
    assert "KVLOOM_PLUGIN_API" not in namespace
    assert "Platform" in namespace and "PLUGIN_API_VERSION" in namespace
