"""Entry-point discovery and loading: the loading policy, the API-version check, type checks.

``load_entry_points`` turns installed entry points into loaded ``PluginEntry``s. It only
imports and checks: what a plugin is *for* (registering a model, becoming the active
platform) is the caller's business, done once everything has loaded, so that a failure
leaves nothing half-registered behind.

The caller describes its groups with ``PluginGroup`` (which base class a target must
subclass, whether names must be unique, which attribute must equal the entry-point name)
and says which plugin API version it provides. Policy, in order:

1. ``KVLOOM_PLUGINS`` (comma-separated entry-point names, applied to every group) keeps
   only the named plugins; unset keeps all, an empty value keeps none. A listed name that
   no installed distribution provides is an error. A group marked ``opt_in`` (plugins
   that widen what a server exposes) keeps only the plugins ``KVLOOM_PLUGINS`` names, also
   when it is unset.
2. In a group with ``unique_names`` two entry points with the same name are an error
   naming both distributions.
3. Each kept plugin's module is imported; an exception is reported with the plugin's
   name, group, distribution and traceback. The module must declare
   ``KVLOOM_PLUGIN_API`` with the same major version as the caller's and a minor
   version no newer (a plugin for 1.0 loads on a kvloom with 1.3, one for 1.3 is
   refused by 1.0: it may use what 1.1 to 1.3 added).
4. The target is checked against its group (a subclass of ``base``, not abstract,
   ``name_attr`` equal to the entry-point name).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any

from kvloom_registry.entry import PluginEntry
from kvloom_registry.errors import (
    DuplicatePluginError,
    PluginAllowlistError,
    PluginAPIVersionError,
    PluginLoadError,
    PluginTypeError,
)

logger = logging.getLogger(__name__)

#: The allowlist: comma-separated entry-point names to load (unset: all).
PLUGINS_ENV = "KVLOOM_PLUGINS"
#: The module-level constant in which a plugin declares the API version it targets.
API_VERSION_ATTR = "KVLOOM_PLUGIN_API"


@dataclass(frozen=True)
class PluginGroup:
    """One entry-point group and the contract of its targets."""

    name: str  # the entry-point group, e.g. "kvloom.attention_backends"
    #: Targets must be (non-abstract) subclasses of this class; None: any object.
    base: type | None = None
    #: Plugins are looked up by name, so two with the same name are an error.
    unique_names: bool = False
    #: The target's attribute that must equal the entry-point name (e.g. "NAME").
    name_attr: str | None = None
    #: How messages call this group's plugins ("attention backends").
    label: str = ""
    #: Load a plugin of this group only when ``KVLOOM_PLUGINS`` names it (unset: none).
    opt_in: bool = False


@dataclass
class LoadedPlugins:
    """The result of loading every group, each group's entries sorted by name."""

    entries: dict[str, list[PluginEntry]] = field(default_factory=dict)
    #: Installed plugins that KVLOOM_PLUGINS left out (target is None), by group.
    excluded: dict[str, list[PluginEntry]] = field(default_factory=dict)
    #: The parsed KVLOOM_PLUGINS value (None = every plugin).
    allowlist: frozenset[str] | None = None

    def group(self, name: str) -> list[PluginEntry]:
        return self.entries.get(name, [])

    def by_name(self, group: str) -> dict[str, PluginEntry]:
        """A group's entries keyed by entry-point name (for ``unique_names`` groups)."""
        return {entry.name: entry for entry in self.group(group)}


def parse_allowlist(value: str | None) -> frozenset[str] | None:
    """``KVLOOM_PLUGINS``: unset -> None (load all); "" -> nothing; "a, b" -> {a, b}."""
    if value is None:
        return None
    return frozenset(name.strip() for name in value.split(",") if name.strip())


def installed_entry_points(groups: Sequence[PluginGroup]) -> dict[str, list[EntryPoint]]:
    """The installed entry points of each group (``importlib.metadata``)."""
    return {group.name: list(entry_points(group=group.name)) for group in groups}


def _distribution_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", "?"
    return dist.metadata["Name"] or dist.name, dist.version


def _entry_of(ep: EntryPoint, group: str) -> PluginEntry:
    distribution, version = _distribution_of(ep)
    return PluginEntry(name=ep.name, group=group, distribution=distribution, version=version, value=ep.value)


def _major_minor(version: object) -> tuple[int, int] | None:
    if not isinstance(version, str):
        return None
    parts = version.strip().split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def check_plugin_api(module: ModuleType, entry: PluginEntry, api_version: str) -> None:
    """Refuse a module that does not declare an API version compatible with ``api_version``."""
    ours = _major_minor(api_version)
    if ours is None:
        raise ValueError(f"api_version must be a \"MAJOR.MINOR\" string, got {api_version!r}")
    where = f"module {module.__name__} ({getattr(module, '__file__', None) or 'no file'})"
    if not hasattr(module, API_VERSION_ATTR):
        raise PluginAPIVersionError(
            f"{entry.describe()} does not declare the kvloom plugin API version it was written "
            f"for. Add the line\n    {API_VERSION_ATTR} = \"{api_version}\"\nto {where}: "
            f"this kvloom provides plugin API {api_version}."
        )
    declared = getattr(module, API_VERSION_ATTR)
    theirs = _major_minor(declared)
    if theirs is None:
        raise PluginAPIVersionError(
            f"{entry.describe()} declares {API_VERSION_ATTR} = {declared!r} in {where}; expected a "
            f"\"MAJOR.MINOR\" string such as \"{api_version}\"."
        )
    if theirs[0] != ours[0]:
        raise PluginAPIVersionError(
            f"{entry.describe()} was written for kvloom plugin API {declared}, but this kvloom "
            f"provides plugin API {api_version}; the major versions must match. Install a "
            f"release of {entry.distribution} made for plugin API {ours[0]}.x, or a kvloom that "
            f"provides plugin API {theirs[0]}.x."
        )
    if theirs[1] > ours[1]:
        # A minor version adds to the API: a plugin written for a newer one may use what
        # this kvloom lacks, and would fail later, in the middle of a request.
        raise PluginAPIVersionError(
            f"{entry.describe()} was written for kvloom plugin API {declared}; this kvloom "
            f"provides plugin API {api_version}, an older minor version that lacks what the plugin "
            f"may use. Upgrade kvloom to a release that provides plugin API {declared} or newer, "
            f"or install a release of {entry.distribution} written for plugin API {api_version}."
        )


def _load_target(ep: EntryPoint, entry: PluginEntry, api_version: str) -> Any:
    """Import the entry point's module, check its API version, resolve the attribute."""
    try:
        module = importlib.import_module(ep.module)
    except Exception as exc:
        raise PluginLoadError.raised(entry, f"failed to load: importing {ep.module} raised", exc) from exc
    check_plugin_api(module, entry, api_version)
    target: Any = module
    for part in ep.attr.split(".") if ep.attr else []:
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise PluginLoadError.for_entry(
                entry,
                f"{entry.describe()} names {ep.value}, but {ep.module} has no attribute {ep.attr!r}",
            ) from exc
    return target


def _check_target(group: PluginGroup, entry: PluginEntry, target: Any) -> None:
    """The group's contract: the right base class, and names that match."""
    base = group.base
    if base is None:  # e.g. general plugins: the caller checks them when it uses them
        return
    if not (inspect.isclass(target) and issubclass(target, base)):
        raise PluginTypeError(
            f"{entry.describe()} names {entry.value} = {target!r}, which is not a subclass of "
            f"{base.__module__}.{base.__qualname__}"
        )
    if inspect.isabstract(target):
        missing = ", ".join(sorted(getattr(target, "__abstractmethods__", ())))
        raise PluginTypeError(
            f"{entry.describe()} names {entry.value}, which does not implement the abstract "
            f"methods {missing} of {base.__qualname__}"
        )
    if group.name_attr is not None and getattr(target, group.name_attr, None) != entry.name:
        kind = group.label.rstrip("s") or "plugin"
        raise PluginLoadError.for_entry(
            entry,
            f"{entry.describe()} names {entry.value} whose {group.name_attr} is "
            f"{getattr(target, group.name_attr, None)!r}; {_article(kind)} {kind}'s entry-point name "
            f"must equal its {group.name_attr}.",
        )


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _check_allowlist(
    entry_points: Mapping[str, Sequence[EntryPoint]], allowlist: frozenset[str] | None
) -> None:
    if allowlist is None:
        return
    installed = {ep.name for eps in entry_points.values() for ep in eps}
    unknown = sorted(allowlist - installed)
    if unknown:
        raise PluginAllowlistError(
            f"{PLUGINS_ENV} lists {', '.join(unknown)}, which no installed plugin provides. "
            f"Installed plugins: {', '.join(sorted(installed)) or 'none'}."
        )


def _check_unique_names(group: PluginGroup, entries: Sequence[PluginEntry]) -> None:
    by_name: dict[str, list[PluginEntry]] = {}
    for entry in entries:
        by_name.setdefault(entry.name, []).append(entry)
    for name, same in by_name.items():
        if len(same) > 1:
            dists = " and ".join(f"{e.distribution} {e.version} ({e.value})" for e in same)
            kind = group.label or f"plugins in {group.name}"
            raise DuplicatePluginError(
                f"Two {kind} are named {name!r}: {dists}. Names must be unique; "
                f"uninstall one of these distributions."
            )


def load_entry_points(
    groups: Sequence[PluginGroup],
    entry_points: Mapping[str, Sequence[EntryPoint]],
    allowlist: frozenset[str] | None,
    api_version: str,
) -> LoadedPlugins:
    """Load every group's plugins, in the order of ``groups``, under the loading policy
    (see the module docstring)."""
    _check_allowlist(entry_points, allowlist)
    loaded = LoadedPlugins(allowlist=allowlist)
    for group in groups:
        eps = sorted(entry_points.get(group.name, ()), key=lambda ep: ep.name)
        kept: list[tuple[EntryPoint, PluginEntry]] = []
        for ep in eps:
            entry = _entry_of(ep, group.name)
            if (allowlist is None and group.opt_in) or (allowlist is not None and ep.name not in allowlist):
                loaded.excluded.setdefault(group.name, []).append(entry)  # never imported
            else:
                kept.append((ep, entry))
        if group.unique_names:
            _check_unique_names(group, [entry for _, entry in kept])
        entries = loaded.entries.setdefault(group.name, [])
        for ep, entry in kept:
            target = _load_target(ep, entry, api_version)
            _check_target(group, entry, target)
            entries.append(dataclasses.replace(entry, target=target))
            logger.debug("Loaded %s -> %s", entry.describe(), entry.value)
    return loaded
