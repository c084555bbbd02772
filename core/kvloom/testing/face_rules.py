"""The rules a change of the plugin API's face must follow (docs/plugins.md, "Compatibility").

A plugin declares the plugin API version it was written for; kvloom loads it when the major
versions match and the plugin's minor is not newer. So within one major version, everything
a plugin of an older minor uses must still be there and still take the same calls:

- an addition (a name, a member, a config field, a parameter with a default appended to a
  function that is not abstract) needs a new minor version;
- a removal, or an incompatible change (a parameter removed, renamed, moved or made
  required, a parameter added to an abstract method, which every plugin overrides, a method
  turned abstract or into another kind, a base class dropped, a constant's or enum member's
  value, a field turned into something else), needs a new major version, unless the old name
  stays as a deprecated alias (``kvloom.deprecation``) for at least one minor version: the
  record marks it ``deprecated: use NEW; goes in X.Y`` and it may go in X.Y, not before;
- a changed type (a parameter's, field's or result's annotation) needs a new minor version,
  and the reviewer's word that the new type accepts every value the old one did (a parameter)
  or gives none the old one did not (a field, a result); otherwise it is incompatible.

A new major version may change anything: the loader refuses plugins of the old major by name.
The entries are the text lines of ``kvloom.testing.face`` (``method(x: int, *, y: str = ...)
-> bool``, ``field: int``, ``class(ABC)``, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvloom.deprecation import Deprecation

__all__ = ["compare_entries", "deprecated_entry", "parse_version", "rule_problems"]

_DEPRECATED = re.compile(r"^deprecated: use (?P<new>.+); goes in (?P<goes_in>\d+\.\d+)$")
_CALLABLE = re.compile(
    r"^(?P<abstract>abstract )?(?P<kind>function|method|classmethod|staticmethod|constructor|hook)\("
)
#: Entries whose text is a value: any change of it is incompatible.
_VALUE_KINDS = ("constant", "member", "group")


def deprecated_entry(deprecation: Deprecation) -> str:
    return f"deprecated: use {deprecation.new}; goes in {deprecation.goes_in}"


def parse_version(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f'a plugin API version is "MAJOR.MINOR", got {version!r}')
    return int(major), int(minor)


@dataclass(frozen=True)
class _Param:
    name: str
    kind: str  # "positional-only", "positional", "keyword-only", "*", "**"
    has_default: bool


def _split_top_level(text: str) -> list[str]:
    parts, depth, start, quote = [], 0, 0, ""
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _parse_callable(text: str) -> tuple[str, bool, list[_Param]] | None:
    """(kind, abstract, parameters) of a callable entry; None for other entries. (A changed
    result type is a changed type, which the caller's fallback reports.)"""
    match = _CALLABLE.match(text)
    if match is None:
        return None
    depth, end = 0, len(text)
    for i in range(match.end() - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            end = i
            break
    params: list[_Param] = []
    tokens = _split_top_level(text[match.end() : end])
    kind = "positional-only" if "/" in tokens else "positional"
    for token in tokens:
        if token == "/":
            kind = "positional"
        elif token == "*":
            kind = "keyword-only"
        elif token.startswith("**"):
            params.append(_Param(token[2:].split(":")[0], "**", True))
        elif token.startswith("*"):
            params.append(_Param(token[1:].split(":")[0], "*", True))
            kind = "keyword-only"
        else:
            params.append(_Param(token.split(":")[0].split("=")[0].strip(), kind, token.endswith("= ...")))
    return match["kind"], bool(match["abstract"]), params


def _signature_break(old: list[_Param], new: list[_Param], abstract: bool) -> str | None:
    """Why a caller (or, for an abstract method, an override) written for ``old`` fails with
    ``new``; None when every old call still works."""
    by_name = {p.name: p for p in new}
    matched: set[str] = set()
    for i, p in enumerate(old):
        if p.kind in ("*", "**"):
            if not any(q.kind == p.kind for q in new):
                return f"its {p.kind}{p.name} was removed"
            matched |= {q.name for q in new if q.kind == p.kind}
            continue
        q = new[i] if p.kind in ("positional-only", "positional") and i < len(new) else by_name.get(p.name)
        if q is None or q.kind in ("*", "**"):
            return f"parameter {p.name!r} was removed or renamed"
        if p.kind == "positional" and (q.name != p.name or q.kind != "positional"):
            return f"parameter {p.name!r} moved, was renamed or became {q.kind}"
        if p.kind == "positional-only" and q.kind not in ("positional-only", "positional"):
            return f"positional parameter {p.name!r} became {q.kind}"
        if p.kind == "keyword-only" and q.kind not in ("keyword-only", "positional"):
            return f"keyword parameter {p.name!r} became {q.kind}"
        if p.has_default and not q.has_default:
            return f"parameter {p.name!r} lost its default"
        matched.add(q.name)
    for q in new:
        if q.name not in matched:
            if not q.has_default:
                return f"new parameter {q.name!r} is required"
            if abstract:
                return f"new parameter {q.name!r} of an abstract method, which plugins' overrides do not take"
    return None


def _bases(class_entry: str) -> set[str]:
    return set(_split_top_level(class_entry.partition("(")[2].rstrip(")")))


def _kind(text: str) -> str:
    return text.split("(")[0].split(":")[0].strip()


def compare_entries(old: str, new: str) -> tuple[bool, str]:
    """``(compatible, what changed)`` for one entry whose text changed."""
    old_dep, new_dep = _DEPRECATED.match(old), _DEPRECATED.match(new)
    if old_dep and new_dep and parse_version(new_dep["goes_in"]) < parse_version(old_dep["goes_in"]):
        return False, f"its removal moved earlier, to {new_dep['goes_in']}"
    if new_dep or old_dep:
        return True, "became a deprecated alias" if new_dep and not old_dep else "its deprecation changed"
    old_call, new_call = _parse_callable(old), _parse_callable(new)
    if old_call and new_call:
        (old_kind, old_abstract, old_params), (new_kind, new_abstract, new_params) = old_call, new_call
        if old_kind != new_kind:
            return False, f"a {old_kind} became a {new_kind}"
        if new_abstract and not old_abstract:
            return False, "became abstract: plugins' subclasses do not implement it"
        why = _signature_break(old_params, new_params, old_abstract or new_abstract)
        if why is not None:
            return False, why
        return True, "its signature changed compatibly (parameters added with defaults, or types)"
    if old.startswith("class") and new.startswith("class"):
        dropped = _bases(old) - _bases(new)
        return (False, f"it no longer derives from {', '.join(sorted(dropped))}") if dropped else (True, "new base")
    if _kind(old) != _kind(new) and {_kind(old), _kind(new)} != {"property", "property (settable)"}:
        return False, f"a {_kind(old)} became a {_kind(new)}"
    if _kind(old) == "property (settable)" and _kind(new) == "property":
        return False, "it can no longer be set"
    if _kind(old) in _VALUE_KINDS:
        return False, "its value changed"
    return True, "its type changed"


def _reported_above(path: str, paths: set[str]) -> bool:
    """Whether an enclosing path (``interfaces.X`` of ``interfaces.X.y``) is in ``paths``."""
    return any(path.startswith((other + ".", other + "[")) for other in paths if other != path)


def _still_served(path: str, new: dict[str, str]) -> bool:
    """Whether ``path``, gone from ``new``, is still served: its class (or module name)
    became a deprecated alias, or the member moved to a base class of the face
    (``interfaces.Worker.x`` now inherited from ``interfaces.WorkerBase.x``)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        enclosing = ".".join(parts[:i])
        if enclosing in new:
            if _DEPRECATED.match(new[enclosing]):
                return True
            bases = _bases(new[enclosing]) if new[enclosing].startswith("class") else set()
            member = ".".join(parts[i:])
            prefix = ".".join(parts[: i - 1])
            return any(f"{prefix}.{base}.{member}" in new or _still_served(f"{prefix}.{base}.{member}", new)
                       for base in bases if f"{prefix}.{base}" in new)  # fmt: skip
    return False


def rule_problems(old: dict[str, str], old_version: str, new: dict[str, str], new_version: str) -> list[str]:
    """What breaks the rules when the face ``old`` of ``old_version`` (the record) becomes
    ``new`` of ``new_version`` (the live face); empty when the change is allowed."""
    before, after = parse_version(old_version), parse_version(new_version)
    if after < before:
        return [f"PLUGIN_API_VERSION {new_version} is older than the record's {old_version}"]
    if after[0] > before[0]:
        return []  # a new major version: plugins of the old one are refused
    next_minor, next_major = f"{before[0]}.{before[1] + 1}", f"{before[0] + 1}.0"
    fix = (f"keep the old name working as a deprecated alias (kvloom.deprecation) for one minor version, "
           f"or make PLUGIN_API_VERSION {next_major}")  # fmt: skip
    problems: list[str] = []
    removed = {path for path in old if path not in new}
    for path in sorted(removed):
        deprecation = _DEPRECATED.match(old[path])
        if _reported_above(path, removed):
            continue
        if deprecation is None:
            if not _still_served(path, new):
                problems.append(f"{path} ({old[path]}) was removed: {fix}")
        elif parse_version(deprecation["goes_in"]) > after:
            problems.append(
                f"{path} is deprecated until plugin API {deprecation['goes_in']}: it cannot go in {new_version}"
            )
    added = new.keys() - old.keys()
    additions = [f"{path} ({new[path]}) was added" for path in sorted(added) if not _reported_above(path, added)]
    for path in sorted(old.keys() & new.keys()):
        if old[path] != new[path]:
            compatible, what = compare_entries(old[path], new[path])
            line = f"{path}: {what} ({old[path]} -> {new[path]})"
            (additions if compatible else problems).append(line if compatible else f"{line}: {fix}")
    for path, text in sorted(new.items()):
        deprecation = _DEPRECATED.match(text)
        if deprecation and old.get(path) != text and parse_version(deprecation["goes_in"]) <= after:
            problems.append(f"{path} is deprecated in {new_version} and must stay until a later minor version, "
                            f"not go in {deprecation['goes_in']}")  # fmt: skip
    if additions and after == before:
        problems.append(f"the face grew or changed compatibly, which needs a new minor version: make "
                        f"PLUGIN_API_VERSION {next_minor} (kvloom/plugins.py) and run python -m kvloom.testing.face "
                        f"--write:\n    " + "\n    ".join(additions))  # fmt: skip
    return problems
