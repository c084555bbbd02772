"""Entry-point discovery and loading: the loading policy, API-version check and type checks.

``load_entry_points`` turns the installed entry points into loaded plugin entries. It
only imports and checks; side effects on the engine (running ``register()`` functions,
registering LoRA resolvers) happen afterwards, once everything has loaded (see
``kvloom.registry.state``), so a failure leaves no half-registered plugins behind.

Policy, in order:

1. ``KVLOOM_PLUGINS`` (comma-separated entry-point names, applied to every group) keeps
   only the named plugins; unset keeps all, an empty value keeps none. A listed name that
   no installed distribution provides is an error.
2. In groups whose plugins are looked up by name (backends, platforms, IO processors,
   LoRA resolvers) two entry points with the same name are an error naming both
   distributions.
3. Each kept plugin's module is imported; an exception is reported with the plugin's
   name, group, distribution and traceback. The module must declare
   ``KVLOOM_PLUGIN_API`` with the same major version as ``PLUGIN_API_VERSION``.
4. The target is checked against its group's contract (a subclass of the right base
   class, ``NAME``/``name`` equal to the entry-point name).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from types import ModuleType
from typing import Any

from kvloom.attention.backend import AttentionBackend
from kvloom.interfaces import PLUGIN_API_VERSION
from kvloom.io_processor import IOProcessor
from kvloom.lora.resolver import LoRAResolver
from kvloom.metrics.stat_logger_base import StatLoggerBase
from kvloom.platform import Platform
from kvloom.registry.errors import (
    DuplicatePluginError,
    PluginAllowlistError,
    PluginAPIVersionError,
    PluginLoadError,
    PluginTypeError,
)

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = "kvloom.attention_backends"
PLATFORM_PLUGINS = "kvloom.platform_plugins"
GENERAL_PLUGINS = "kvloom.general_plugins"
IO_PROCESSOR_PLUGINS = "kvloom.io_processor_plugins"
STAT_LOGGER_PLUGINS = "kvloom.stat_logger_plugins"
LORA_RESOLVERS = "kvloom.lora_resolvers"

#: Every entry-point group kvloom reads, in loading order.
ALL_GROUPS: tuple[str, ...] = (
    PLATFORM_PLUGINS,
    ATTENTION_BACKENDS,
    GENERAL_PLUGINS,
    IO_PROCESSOR_PLUGINS,
    STAT_LOGGER_PLUGINS,
    LORA_RESOLVERS,
)

#: Groups whose plugins are looked up by entry-point name, so names must be unique.
_NAMED_GROUPS = (ATTENTION_BACKENDS, PLATFORM_PLUGINS, IO_PROCESSOR_PLUGINS, LORA_RESOLVERS)

#: The base class each group's target must subclass.
_BASE_CLASSES: dict[str, type] = {
    ATTENTION_BACKENDS: AttentionBackend,
    PLATFORM_PLUGINS: Platform,
    IO_PROCESSOR_PLUGINS: IOProcessor,
    STAT_LOGGER_PLUGINS: StatLoggerBase,
    LORA_RESOLVERS: LoRAResolver,
}

PLUGINS_ENV = "KVLOOM_PLUGINS"


@dataclass(frozen=True)
class PluginEntry:
    """One plugin: where it comes from and (once loaded) what its entry point names."""

    name: str  # the entry-point name
    group: str
    distribution: str  # the pip distribution that declares the entry point
    version: str  # that distribution's version
    value: str  # the entry point's "module:attr" text
    target: Any = None  # the loaded object; None for plugins KVLOOM_PLUGINS excluded

    @property
    def cls(self) -> Any:
        """The loaded class (for groups whose targets are classes)."""
        return self.target

    def describe(self) -> str:
        """How error messages name this plugin."""
        return f"plugin {self.name!r} (group {self.group}, distribution {self.distribution} {self.version})"


@dataclass
class LoadedPlugins:
    """The result of loading every group. Keyed groups map entry-point name -> entry."""

    attention_backends: dict[str, PluginEntry] = field(default_factory=dict)
    platforms: dict[str, PluginEntry] = field(default_factory=dict)
    io_processors: dict[str, PluginEntry] = field(default_factory=dict)
    lora_resolvers: dict[str, PluginEntry] = field(default_factory=dict)
    stat_loggers: list[PluginEntry] = field(default_factory=list)
    general: list[PluginEntry] = field(default_factory=list)
    #: Installed plugins that KVLOOM_PLUGINS left out (target is None), by group.
    excluded: dict[str, list[PluginEntry]] = field(default_factory=dict)
    #: The parsed KVLOOM_PLUGINS value (None = every plugin).
    allowlist: frozenset[str] | None = None


def parse_allowlist(value: str | None) -> frozenset[str] | None:
    """``KVLOOM_PLUGINS``: unset -> None (load all); "" -> nothing; "a, b" -> {a, b}."""
    if value is None:
        return None
    return frozenset(name.strip() for name in value.split(",") if name.strip())


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


def check_plugin_api(module: ModuleType, entry: PluginEntry) -> None:
    """Refuse a module that does not declare a compatible ``KVLOOM_PLUGIN_API``."""
    ours = _major_minor(PLUGIN_API_VERSION)
    assert ours is not None
    where = f"module {module.__name__} ({getattr(module, '__file__', None) or 'no file'})"
    if not hasattr(module, "KVLOOM_PLUGIN_API"):
        raise PluginAPIVersionError(
            f"{entry.describe()} does not declare the kvloom plugin API version it was written "
            f"for. Add the line\n    KVLOOM_PLUGIN_API = \"{PLUGIN_API_VERSION}\"\nto {where}: "
            f"this kvloom provides plugin API {PLUGIN_API_VERSION}."
        )
    declared = module.KVLOOM_PLUGIN_API
    theirs = _major_minor(declared)
    if theirs is None:
        raise PluginAPIVersionError(
            f"{entry.describe()} declares KVLOOM_PLUGIN_API = {declared!r} in {where}; expected a "
            f"\"MAJOR.MINOR\" string such as \"{PLUGIN_API_VERSION}\"."
        )
    if theirs[0] != ours[0]:
        raise PluginAPIVersionError(
            f"{entry.describe()} was written for kvloom plugin API {declared}, but this kvloom "
            f"provides plugin API {PLUGIN_API_VERSION}; the major versions must match. Install a "
            f"release of {entry.distribution} made for plugin API {ours[0]}.x, or a kvloom that "
            f"provides plugin API {theirs[0]}.x."
        )
    if theirs[1] > ours[1]:
        logger.warning(
            "%s was written for kvloom plugin API %s, newer than this kvloom's %s; "
            "features it relies on may be missing.",
            entry.describe(),
            declared,
            PLUGIN_API_VERSION,
        )


def _load_target(ep: EntryPoint, entry: PluginEntry) -> Any:
    """Import the entry point's module, check its API version, resolve the attribute."""
    try:
        module = importlib.import_module(ep.module)
    except Exception as exc:
        tb = traceback.format_exc()
        raise PluginLoadError.for_entry(
            entry,
            f"{entry.describe()} failed to load: importing {ep.module} raised "
            f"{type(exc).__name__}: {exc}\n{tb}",
            traceback_text=tb,
        ) from exc
    check_plugin_api(module, entry)
    target: Any = module
    for part in (ep.attr or "").split(".") if ep.attr else []:
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise PluginLoadError.for_entry(
                entry,
                f"{entry.describe()} names {ep.value}, but {ep.module} has no attribute {ep.attr!r}",
            ) from exc
    return target


def _check_target(entry: PluginEntry, target: Any) -> None:
    """The group's contract: the right base class, and names that match."""
    base = _BASE_CLASSES.get(entry.group)
    if base is None:  # general plugins: checked when they are registered
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
    if entry.group == ATTENTION_BACKENDS and getattr(target, "NAME", None) != entry.name:
        raise PluginLoadError.for_entry(
            entry,
            f"{entry.describe()} names {entry.value} whose NAME is {getattr(target, 'NAME', None)!r}; "
            f"an attention backend's entry-point name must equal its NAME.",
        )
    if entry.group == PLATFORM_PLUGINS and getattr(target, "name", None) != entry.name:
        raise PluginLoadError.for_entry(
            entry,
            f"{entry.describe()} names {entry.value} whose name is {getattr(target, 'name', None)!r}; "
            f"a platform's entry-point name must equal its name.",
        )


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


def _check_unique_names(group: str, entries: Sequence[PluginEntry]) -> None:
    by_name: dict[str, list[PluginEntry]] = {}
    for entry in entries:
        by_name.setdefault(entry.name, []).append(entry)
    for name, same in by_name.items():
        if len(same) > 1:
            dists = " and ".join(f"{e.distribution} {e.version} ({e.value})" for e in same)
            kind = "attention backends" if group == ATTENTION_BACKENDS else f"plugins in {group}"
            raise DuplicatePluginError(
                f"Two {kind} are named {name!r}: {dists}. Names must be unique; "
                f"uninstall one of these distributions."
            )


def load_entry_points(
    entry_points: Mapping[str, Sequence[EntryPoint]], allowlist: frozenset[str] | None
) -> LoadedPlugins:
    """Load every group's plugins under the loading policy (see the module docstring)."""
    _check_allowlist(entry_points, allowlist)
    loaded = LoadedPlugins(allowlist=allowlist)
    for group in ALL_GROUPS:
        eps = sorted(entry_points.get(group, ()), key=lambda ep: ep.name)
        kept: list[tuple[EntryPoint, PluginEntry]] = []
        for ep in eps:
            entry = _entry_of(ep, group)
            if allowlist is not None and ep.name not in allowlist:
                loaded.excluded.setdefault(group, []).append(entry)  # never imported
            else:
                kept.append((ep, entry))
        if group in _NAMED_GROUPS:
            _check_unique_names(group, [entry for _, entry in kept])
        for ep, entry in kept:
            target = _load_target(ep, entry)
            _check_target(entry, target)
            entry = dataclasses.replace(entry, target=target)
            logger.debug("Loaded %s -> %s", entry.describe(), entry.value)
            if group == ATTENTION_BACKENDS:
                loaded.attention_backends[entry.name] = entry
            elif group == PLATFORM_PLUGINS:
                loaded.platforms[entry.name] = entry
            elif group == IO_PROCESSOR_PLUGINS:
                loaded.io_processors[entry.name] = entry
            elif group == LORA_RESOLVERS:
                loaded.lora_resolvers[entry.name] = entry
            elif group == STAT_LOGGER_PLUGINS:
                loaded.stat_loggers.append(entry)
            else:
                loaded.general.append(entry)
    return loaded
