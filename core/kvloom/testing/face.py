"""The plugin API's face, recorded: every name, signature and config field a plugin may use.

A plugin written for plugin API 1.0 must keep working on every kvloom 1.x (docs/plugins.md,
"Compatibility"). To keep that promise, the face is written down in
``kvloom/interfaces/face.json`` and ``tests/test_plugin_api_compat.py`` compares it with
the live face under the rules of ``kvloom.testing.face_rules``::

    python -m kvloom.testing.face           # what differs from the record, and what it needs
    python -m kvloom.testing.face --write   # check the rules, then rewrite the record

The record maps each path a plugin writes to one line saying what it is:

- ``interfaces.NAME`` / ``interfaces.models.NAME``: the names of the two face modules'
  ``__all__`` (functions with their parameters; classes with their bases, constructor,
  methods, properties, class attributes, ClassVars, dataclass and pydantic fields; enum
  members; constants with their values), and their deprecated aliases;
- ``config.SECTION.FIELD``: the ``EngineConfig`` plugins receive, field by field, with its
  properties and deprecated aliases (``config.attention_backend``);
- ``runner.METHOD``: the model-runner methods platforms' workers call (``self.runner``);
- ``hooks.HOOK`` and ``entry_points.GROUP``: the general plugins' hooks and the entry-point
  groups with the contract of their targets.

Types are written by name without their module (``EngineConfig``, ``Tensor``), so moving a
class between kvloom modules does not change the face. Attributes that ``__init__`` sets on
an instance are not recorded (as in the API reference).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ForwardRef

from pydantic import BaseModel

import kvloom.interfaces
from kvloom.deprecation import Deprecation
from kvloom.hookspecs import GeneralPluginSpec
from kvloom.plugins import GROUPS, PLUGIN_API_VERSION
from kvloom.testing.face_rules import deprecated_entry, rule_problems

__all__ = ["FACE_MODULES", "RECORD", "RUNNER_METHODS", "Face", "live_face", "read_record", "write_record"]

FACE_MODULES = ("kvloom.interfaces", "kvloom.interfaces.models")
"""The modules plugins import from."""
RUNNER_METHODS = tuple(sorted(n for n, v in vars(kvloom.interfaces.ModelRunnerProtocol).items()
                              if not n.startswith("_") and inspect.isfunction(v)))  # fmt: skip
"""The model runner methods a worker (so a platform) may call: ``ModelRunnerProtocol``'s."""
RECORD = Path(kvloom.interfaces.__file__).with_name("face.json")
"""The committed record of the face."""

#: Pydantic's own members of a model class, no kvloom contract.
_PYDANTIC_INTERNALS = frozenset({"model_config", "model_fields", "model_computed_fields", "model_post_init"})


@dataclasses.dataclass(frozen=True)
class Face:
    """A face: the plugin API version it is of, and path -> what is there."""

    version: str
    entries: dict[str, str]


# ---------------------------------------------------------------------- types and signatures


def type_text(annotation: Any) -> str:
    """An annotation as names without modules: ``type[kvloom.attention.backend.AttentionBackend]``
    and ``"type[AttentionBackend]"`` both read ``type[AttentionBackend]``."""
    if isinstance(annotation, ForwardRef):
        annotation = annotation.__forward_arg__
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a string annotation under __future__
        text = text[1:-1]
    text = re.sub(r"ForwardRef\('([^()]*)'\)", r"\1", text.replace('"', "'"))
    # type['Platform'] -> type[Platform]; Literal['fcfs'] keeps its strings
    literals = re.findall(r"Literal\[[^\]]*\]", text)
    text = re.sub(r"'([A-Za-z_][\w.]*)'", r"\1", re.sub(r"Literal\[[^\]]*\]", "Literal[\0]", text))
    for literal in literals:
        text = text.replace("Literal[\0]", literal, 1)
    text = re.sub(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])", "", text)  # torch.Tensor -> Tensor
    return re.sub(r"\s+", " ", text).strip()


def signature_text(func: Any, drop_first: bool = False) -> str:
    """``(a: int, /, b: str = ..., *, c: bool = ..., **kwargs) -> T``: names, kinds,
    annotations and whether each parameter has a default (not the default's value)."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return "(...)"
    params = list(sig.parameters.values())
    if drop_first and params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    parts: list[str] = []
    star_written = False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star_written:
            parts.append("*")
        star_written = star_written or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {type_text(p.annotation)}"
        if p.default is not p.empty:
            text += " = ..."
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    result = "" if sig.return_annotation is sig.empty else f" -> {type_text(sig.return_annotation)}"
    return f"({', '.join(parts)}){result}"


def _value_text(value: Any) -> str:
    return re.sub(r"\s+", " ", repr(value.value if isinstance(value, enum.Enum) else value))


def _is_literal(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    return isinstance(value, (tuple, list, frozenset)) and all(_is_literal(v) for v in value)


# ---------------------------------------------------------------------- the face's parts


def _is_kvloom(cls: type) -> bool:
    return cls.__module__ == "kvloom" or cls.__module__.startswith("kvloom.")


def _member_text(cls: type, name: str, value: Any, annotations: dict[str, Any]) -> str | None:
    """What a class's member is, or None for what is no contract (a nested helper value)."""
    if isinstance(value, property):
        deprecation = getattr(value.fget, "deprecation", None)
        if isinstance(deprecation, Deprecation):
            return deprecated_entry(deprecation)
        returns = inspect.signature(value.fget).return_annotation if value.fget else inspect.Signature.empty
        settable = " (settable)" if value.fset is not None else ""
        return f"property{settable}: {type_text(returns) if returns is not inspect.Signature.empty else '?'}"
    if isinstance(value, staticmethod):
        return f"staticmethod{signature_text(value.__func__)}"
    if isinstance(value, classmethod):
        return f"classmethod{signature_text(value.__func__, drop_first=True)}"
    if inspect.isfunction(value):
        deprecation = getattr(value, "deprecation", None)
        if isinstance(deprecation, Deprecation):
            return deprecated_entry(deprecation)
        abstract = "abstract " if getattr(value, "__isabstractmethod__", False) else ""
        return f"{abstract}method{signature_text(value, drop_first=True)}"
    if isinstance(value, enum.Enum) and isinstance(cls, enum.EnumMeta):
        return f"member: {_value_text(value)}"
    if name in annotations:
        return f"attribute: {type_text(annotations[name])}"
    if inspect.isclass(value):
        return "class"
    if hasattr(value, "__get__") and not _is_literal(value):  # functools.cached_property and friends
        return "property: ?"
    return f"attribute: {type(value).__name__}"


def _fields(cls: type) -> dict[str, str]:
    """Dataclass, pydantic and named-tuple fields: name -> ``field: TYPE``."""
    if dataclasses.is_dataclass(cls):
        return {f.name: f"field: {type_text(f.type)}" for f in dataclasses.fields(cls)}
    if issubclass(cls, BaseModel):
        return {name: f"field: {type_text(f.annotation)}" for name, f in cls.model_fields.items()}
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        hints = getattr(cls, "__annotations__", {})
        return {name: f"field: {type_text(hints.get(name, 'Any'))}" for name in cls._fields}
    return {}


def _constructor(cls: type) -> str | None:
    """The constructor's parameters, where a kvloom class (or dataclass) defines them."""
    if issubclass(cls, (enum.Enum, BaseModel)):  # members / keyword fields, recorded as such
        return None
    if not (inspect.isfunction(cls.__init__) or inspect.isfunction(cls.__new__)):
        return None  # object's or a builtin's
    return f"constructor{signature_text(cls)}"


def _class_entries(path: str, cls: type, face_classes: set[type]) -> dict[str, str]:
    """A class, its constructor and its public members. Members it inherits from another
    class of the face are that class's entries, not repeated here."""
    bases = ", ".join(b.__name__ for b in cls.__bases__ if b is not object)
    entries = {path: f"class({bases})" if bases else "class"}
    if (constructor := _constructor(cls)) is not None:
        entries[f"{path}.__init__"] = constructor
    fields = _fields(cls)
    entries.update({f"{path}.{name}": text for name, text in fields.items()})
    owners = [c for c in cls.__mro__ if _is_kvloom(c)]
    annotations: dict[str, Any] = {}
    for owner in reversed(owners):  # the nearest class's annotation wins
        annotations.update(vars(owner).get("__annotations__", {}))
    seen = set(fields)
    for owner in owners:
        if owner is not cls and owner in face_classes:
            break
        for name in [*vars(owner), *vars(owner).get("__annotations__", {})]:
            if name.startswith("_") or name in seen or name in _PYDANTIC_INTERNALS:
                continue
            seen.add(name)
            value = vars(owner).get(name, inspect.Parameter.empty)
            if value is inspect.Parameter.empty:  # annotated only (a ClassVar without a value)
                entries[f"{path}.{name}"] = f"attribute: {type_text(annotations[name])}"
            elif (text := _member_text(cls, name, value, annotations)) is not None:
                entries[f"{path}.{name}"] = text
    return entries


def _config_entries(path: str, model: type[BaseModel], sections: dict[type, str]) -> dict[str, str]:
    """The engine config plugins receive, as they read it (``config.attention.backend``);
    ``sections`` collects each section class's path."""
    sections[model] = path
    entries: dict[str, str] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            entries[f"{path}.{name}"] = f"section: {annotation.__name__}"
            entries.update(_config_entries(f"{path}.{name}", annotation, sections))
        else:
            entries[f"{path}.{name}"] = f"field: {type_text(annotation)}"
    for name, value in vars(model).items():
        if not name.startswith("_") and isinstance(value, property):
            entries[f"{path}.{name}"] = _member_text(model, name, value, {}) or ""
    return entries


def _module_deprecations(module: Any) -> dict[str, Deprecation]:
    """A face module's deprecated aliases (``kvloom.deprecation.deprecated_attributes``)."""
    return dict(getattr(module.__dict__.get("__getattr__"), "deprecations", {}))


class _FaceModules:
    """The names of the face modules, each described once (a second name of the same
    object reads ``same as ...``)."""

    def __init__(self, sections: dict[type, str]) -> None:
        self.sections = sections
        self.modules = [importlib.import_module(name) for name in FACE_MODULES]
        self.values = {
            f"{module.__name__.removeprefix('kvloom.')}.{name}": getattr(module, name)
            for module in self.modules
            for name in module.__all__
            if name != "PLUGIN_API_VERSION"  # the face's version, not part of it
        }
        self.classes = {value for value in self.values.values() if inspect.isclass(value)}
        self.described: dict[int, str] = {}

    def entries(self) -> dict[str, str]:
        entries: dict[str, str] = {}
        for path, value in self.values.items():
            entries.update(self.describe(path, value))
        for module in self.modules:
            for name, deprecation in _module_deprecations(module).items():
                entries[f"{module.__name__.removeprefix('kvloom.')}.{name}"] = deprecated_entry(deprecation)
        return entries

    def describe(self, path: str, value: Any) -> dict[str, str]:
        """One name: a class, function, constant, type alias or instance."""
        if id(value) in self.described:
            return {path: f"same as {self.described[id(value)]}"}
        self.described[id(value)] = path
        if inspect.isclass(value) and value in self.sections:
            return {path: f"config section: fields under {self.sections[value]}"}
        if inspect.isclass(value):
            return _class_entries(path, value, self.classes)
        if inspect.isfunction(value):
            return {path: f"function{signature_text(value)}"}
        if isinstance(value, dict) and all(_is_literal(k) and _is_literal(v) for k, v in value.items()):
            items = {f"{path}[{k!r}]": f"constant: {_value_text(v)}" for k, v in value.items()}
            return {path: "constant: dict", **items}
        if _is_literal(value):
            return {path: f"constant: {_value_text(value)}"}
        if type(value).__module__ in ("typing", "types"):  # a union or other type alias
            return {path: f"type alias: {type_text(value)}"}
        cls = type(value)  # an instance: a registry, pluggy's marker
        entries = {path: f"instance of {cls.__name__}"}
        if _is_kvloom(cls):
            members = _class_entries(path, cls, self.classes)
            entries.update({p: t for p, t in members.items() if p != path and not p.endswith(".__init__")})
        return entries


def _plugin_machinery_entries() -> dict[str, str]:
    """The runner methods platforms call (``ModelRunnerProtocol``'s), the general plugins'
    hooks, the entry-point groups."""
    entries: dict[str, str] = {}
    runner = kvloom.interfaces.ModelRunnerProtocol
    for name in RUNNER_METHODS:
        entries[f"runner.{name}"] = f"method{signature_text(getattr(runner, name), drop_first=True)}"
    for name, hook in vars(GeneralPluginSpec).items():
        if inspect.isfunction(hook):
            entries[f"hooks.{name}"] = f"hook{signature_text(hook, drop_first=True)}"
    for group in GROUPS:
        target = f"{group.base.__name__} subclass" if group.base is not None else "any object"
        unique = ", unique names" if group.unique_names else ""
        named = f", entry-point name = its {group.name_attr}" if group.name_attr else ""
        entries[f"entry_points.{group.name}"] = f"group: {target}{unique}{named}"
    return entries


def live_face() -> Face:
    """The face of this kvloom, read from the live modules."""
    from kvloom.config import EngineConfig

    sections: dict[type, str] = {}
    entries = _config_entries("config", EngineConfig, sections)
    entries.update(_FaceModules(sections).entries())
    entries.update(_plugin_machinery_entries())
    return Face(PLUGIN_API_VERSION, dict(sorted(entries.items())))


# ---------------------------------------------------------------------- the record


def read_record(path: Path = RECORD) -> Face:
    data = json.loads(path.read_text())
    return Face(data["plugin_api_version"], data["face"])


def write_record(face: Face, path: Path = RECORD) -> None:
    """One entry a line, sorted: a change to the face is a readable diff."""
    data = {
        "plugin_api_version": face.version,
        "about": "The plugin API's face (kvloom.testing.face). Regenerate: python -m kvloom.testing.face --write",
        "face": dict(sorted(face.entries.items())),
    }
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def stale_entries(record: Face, live: Face) -> list[str]:
    """What the record says differently from the live face (empty: up to date)."""
    lines = [f"version: {record.version} -> {live.version}"] if record.version != live.version else []
    for path in sorted(record.entries.keys() | live.entries.keys()):
        old, new = record.entries.get(path), live.entries.get(path)
        if old != new:
            lines.append(f"{path}: {old or '(absent)'} -> {new or '(absent)'}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.testing.face", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the record, if the rules allow the change")
    parser.add_argument("--record", type=Path, default=RECORD, help=f"the record (default: {RECORD})")
    args = parser.parse_args(argv)
    live = live_face()
    record = read_record(args.record) if args.record.is_file() else None
    problems = [] if record is None else rule_problems(record.entries, record.version, live.entries, live.version)
    if problems:
        print("The plugin API's face changed against the rules (docs/plugins.md, Compatibility):")
        print("\n".join(f"  - {p}" for p in problems))
        return 1
    stale = stale_entries(record, live) if record is not None else ["(no record yet)"]
    if args.write:
        write_record(live, args.record)
        print(f"Wrote {args.record} (plugin API {live.version}, {len(live.entries)} entries, {len(stale)} changed).")
        return 0
    if stale:
        print(f"{args.record} is out of date; run python -m kvloom.testing.face --write:")
        print("\n".join(f"  {line}" for line in stale))
        return 1
    print(f"The face matches {args.record} (plugin API {live.version}, {len(live.entries)} entries).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
