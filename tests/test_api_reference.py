"""The API reference builds from the docstrings, and every public name has a docstring.

``scripts/build-api-docs.sh`` (pdoc) renders ``kvloom.interfaces``,
``kvloom.interfaces.models`` and ``kvloom.testing`` into a temporary directory, exactly as a
developer builds ``docs/api/``. Then every name of the ``__all__`` of ``kvloom.interfaces``,
``kvloom.interfaces.models`` and the test-setup helpers (``kvloom.testing.models``,
``.lora``, ``.install``) must have its entry in the rendered page with a
docstring of its own (not one inherited from ``abc.ABC`` or ``torch.nn.Module``), and so
must every public member that a kvloom class of those lists defines: methods, properties,
class attributes, dataclass fields and enum members (attributes set in ``__init__`` are
left out). A contract without a docstring fails here.
"""

from __future__ import annotations

import enum
import html
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
MODULES = (
    "kvloom.interfaces",
    "kvloom.interfaces.models",
    "kvloom.testing.models",
    "kvloom.testing.lora",
    "kvloom.testing.install",
)
#: Pydantic's own class attributes, not part of any kvloom contract.
PYDANTIC_INTERNALS = {"model_config", "model_fields", "model_computed_fields"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("api") / "api"
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(REPO / "scripts" / "build-api-docs.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def page(reference: Path, module: str) -> str:
    path = reference / (module.replace(".", "/") + ".html")
    assert path.is_file(), f"the reference has no page for {module}"
    return path.read_text()


def entries(text: str) -> dict[str, str]:
    """Each rendered entry (``<section id=NAME>`` or ``<div id=Class.member>``) -> its own HTML,
    up to the next entry."""
    marks = list(re.finditer(r'<(?:section|div) id="([A-Za-z_][\w.]*)"', text))
    return {m[1]: text[m.end() : nxt.start() if nxt else len(text)] for m, nxt in zip(marks, marks[1:] + [None])}


def has_docstring(fragment: str) -> bool:
    match = re.search(r'<div class="docstring">(.*?)</div>', fragment, re.DOTALL)
    return match is not None and bool(html.unescape(re.sub(r"<[^>]+>", "", match[1])).strip())


def own_docstring(obj: object) -> str | None:
    """The object's own docstring; a class's must not be inherited (``inspect.getdoc`` would)."""
    if inspect.isclass(obj):
        return obj.__dict__.get("__doc__")
    return getattr(obj, "__doc__", None) if inspect.isroutine(obj) else None


def contract_members(cls: type) -> list[str]:
    """Public members a kvloom class defines itself, apart from attributes set in ``__init__``."""
    names = set(vars(cls).get("__annotations__", {})) | set(vars(cls))  # fields, class attributes, methods
    if issubclass(cls, enum.Enum):
        names |= set(cls.__members__)
    if issubclass(cls, BaseModel):
        names |= set(vars(cls).get("__pydantic_fields__", {})) & set(vars(cls).get("__annotations__", {}))
    return sorted(n for n in names if not n.startswith("_") and n not in PYDANTIC_INTERNALS)


def public_names(module: str) -> list[tuple[str, object]]:
    mod = importlib.import_module(module)
    return [(name, getattr(mod, name)) for name in mod.__all__]


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_has_a_documented_entry(reference: Path, module: str) -> None:
    rendered = entries(page(reference, module))
    problems = []
    for name, obj in public_names(module):
        if name not in rendered:
            problems.append(f"{name}: no entry")
        elif not has_docstring(rendered[name].split('class="classattr"')[0]):
            problems.append(f"{name}: no docstring")
        elif inspect.isclass(obj) and not (own_docstring(obj) or "").strip():
            problems.append(f"{name}: only an inherited docstring ({obj.__module__}.{obj.__qualname__})")
    assert not problems, f"{module}: " + "; ".join(problems)


@pytest.mark.parametrize("module", MODULES)
def test_every_member_of_the_contract_classes_is_documented(reference: Path, module: str) -> None:
    rendered = entries(page(reference, module))
    problems = []
    for name, obj in public_names(module):
        if not inspect.isclass(obj) or not obj.__module__.startswith("kvloom."):
            continue
        for member in contract_members(obj):
            key = f"{name}.{member}"
            if key not in rendered:
                problems.append(f"{key}: no entry")
            elif not has_docstring(rendered[key]):
                problems.append(f"{key} ({obj.__module__})")
    assert not problems, f"{len(problems)} undocumented members in {module}: " + ", ".join(problems)
