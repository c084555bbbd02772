"""The plugins of this process: loaded once (``load_plugins``), then queried.

Every accessor loads the plugins first, so callers never see a half-initialised
registry. Loading is idempotent: the first call does the work, later calls return at
once; if the first call failed, every later call raises the same error (a process whose
plugins failed to load stays failed instead of running with some plugins missing).
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from kvloom.attention.backend import AttentionBackend, AttentionSelectorConfig
from kvloom.lora.resolver import LoRAResolverRegistry
from kvloom.models.registry import ModelRegistry
from kvloom.platform import Platform
from kvloom.registry.errors import BackendSelectionError, DuplicatePluginError, PluginLoadError
from kvloom.registry.general import GeneralPlugins
from kvloom.registry.loader import (
    ALL_GROUPS,
    ATTENTION_BACKENDS,
    PLATFORM_PLUGINS,
    PLUGINS_ENV,
    LoadedPlugins,
    PluginEntry,
    load_entry_points,
    parse_allowlist,
)
from kvloom.registry.platforms import PLATFORM_ENV, resolve_platform
from kvloom.registry.selection import SelectionReport, SelectionResult, report_backends, select_backend

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.io_processor import IOProcessor
    from kvloom.metrics.stat_logger_base import StatLoggerBase

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_loaded: LoadedPlugins | None = None
_general: GeneralPlugins | None = None
_failure: BaseException | None = None
_platform: PluginEntry | None = None


def _register_lora_resolvers(plugins: LoadedPlugins) -> None:
    for name, entry in plugins.lora_resolvers.items():
        try:
            resolver = entry.target()
        except Exception as exc:
            tb = traceback.format_exc()
            raise PluginLoadError(
                f"{entry.describe()} failed while instantiating {entry.value}: "
                f"{type(exc).__name__}: {exc}\n{tb}",
                plugin=name,
                group=entry.group,
                distribution=entry.distribution,
                traceback_text=tb,
            ) from exc
        try:
            LoRAResolverRegistry.register_resolver(name, resolver)
        except ValueError as exc:
            raise DuplicatePluginError(f"{entry.describe()}: {exc}") from exc


def load_plugins() -> None:
    """Discover and load every kvloom plugin of this process (idempotent)."""
    global _loaded, _general, _failure
    with _lock:
        if _loaded is not None:
            return
        if _failure is not None:
            raise _failure
        try:
            allowlist = parse_allowlist(os.environ.get(PLUGINS_ENV))
            eps = {group: list(entry_points(group=group)) for group in ALL_GROUPS}
            plugins = load_entry_points(eps, allowlist)
            _register_lora_resolvers(plugins)
            general = GeneralPlugins()
            general.load(plugins.general, model_registry=ModelRegistry, resolver_registry=LoRAResolverRegistry)
        except Exception as exc:
            _failure = exc
            raise
        _loaded, _general = plugins, general
        logger.debug(
            "kvloom plugins loaded: platforms=%s backends=%s general=%s io_processors=%s "
            "stat_loggers=%s lora_resolvers=%s",
            sorted(plugins.platforms),
            sorted(plugins.attention_backends),
            [e.name for e in plugins.general],
            sorted(plugins.io_processors),
            [e.name for e in plugins.stat_loggers],
            sorted(plugins.lora_resolvers),
        )


def loaded_plugins() -> LoadedPlugins:
    """Everything that was loaded (and what ``KVLOOM_PLUGINS`` excluded)."""
    load_plugins()
    assert _loaded is not None
    return _loaded


def reset_for_tests() -> None:
    """Forget the loaded plugins, the active platform and a cached load failure, so the
    next call loads again (e.g. after a test changed KVLOOM_PLUGINS). Also clears the
    LoRA resolver registry, which loading fills. Model registrations stay (re-registering
    is a no-op)."""
    global _loaded, _general, _failure, _platform
    with _lock:
        _loaded = _general = _failure = _platform = None
        LoRAResolverRegistry.clear()


# ---------------------------------------------------------------------- attention backends


def attention_backends() -> dict[str, PluginEntry]:
    """Loaded attention backends: NAME -> entry (``.cls``, ``.distribution``, ``.version``)."""
    return dict(loaded_plugins().attention_backends)


def get_attention_backend(name: str) -> type[AttentionBackend]:
    backends = loaded_plugins().attention_backends
    if name not in backends:
        raise BackendSelectionError(
            f"Unknown attention backend {name!r}. Valid names: {', '.join(sorted(backends)) or 'none'}."
        )
    return backends[name].target


def _backend_sources(
    backends: Mapping[str, PluginEntry] | None,
) -> tuple[Mapping[str, PluginEntry], list[PluginEntry]]:
    if backends is not None:  # injected (tests, tools): no global state involved
        return backends, []
    plugins = loaded_plugins()
    return plugins.attention_backends, plugins.excluded.get(ATTENTION_BACKENDS, [])


def select_attention_backend(
    platform: type[Platform],
    selector_config: AttentionSelectorConfig,
    requested: str | None = None,
    *,
    backends: Mapping[str, PluginEntry] | None = None,
) -> SelectionResult:
    """Pick the attention backend for ``selector_config`` on ``platform``.

    ``requested`` is the user's ``attention_backend`` (None = by priority).
    ``backends`` replaces the loaded backends (NAME -> entry) when given.
    Raises ``BackendSelectionError`` (a ``ValueError``) with every reason.
    """
    installed, excluded = _backend_sources(backends)
    return select_backend(platform, selector_config, requested, installed, excluded)


def report_attention_backends(
    platform: type[Platform],
    selector_config: AttentionSelectorConfig,
    requested: str | None = None,
    *,
    backends: Mapping[str, PluginEntry] | None = None,
) -> SelectionReport:
    """The priority table and the selection outcome, without raising on selection errors."""
    installed, excluded = _backend_sources(backends)
    return report_backends(platform, selector_config, requested, installed, excluded)


# ---------------------------------------------------------------------- platforms


def platforms() -> dict[str, PluginEntry]:
    """Loaded platforms: name -> entry (available or not)."""
    return dict(loaded_plugins().platforms)


def current_platform_entry() -> PluginEntry:
    """The active platform's entry (resolved once per process)."""
    global _platform
    plugins = loaded_plugins()
    with _lock:
        if _platform is None:
            _platform = resolve_platform(
                plugins.platforms,
                forced=os.environ.get(PLATFORM_ENV) or None,
                excluded=plugins.excluded.get(PLATFORM_PLUGINS, []),
            )
            logger.debug("Active platform: %s (%s)", _platform.name, _platform.distribution)
        return _platform


def current_platform() -> type[Platform]:
    """The active platform class (see ``kvloom.registry.platforms`` for the rules)."""
    return current_platform_entry().target


def get_platform_by_name(name: str) -> type[Platform]:
    plugins = loaded_plugins()
    if name not in plugins.platforms:
        excluded = {e.name for e in plugins.excluded.get(PLATFORM_PLUGINS, [])}
        why = f"it is installed but {PLUGINS_ENV} does not list it" if name in excluded else "unknown platform"
        raise ValueError(
            f"Platform {name!r}: {why}. Loaded platforms: {', '.join(sorted(plugins.platforms)) or 'none'}."
        )
    return plugins.platforms[name].target


# ---------------------------------------------------------------------- other plugin kinds


def io_processor_plugins() -> dict[str, type["IOProcessor"]]:
    return {name: entry.target for name, entry in loaded_plugins().io_processors.items()}


def get_io_processor_cls(name: str) -> type["IOProcessor"]:
    processors = io_processor_plugins()
    if name not in processors:
        raise ValueError(
            f"io_processor_plugin: no IO processor plugin named {name!r} is loaded "
            f"(installed: {', '.join(sorted(processors)) or 'none'})"
        )
    return processors[name]


def stat_logger_classes() -> list[type["StatLoggerBase"]]:
    return [entry.target for entry in loaded_plugins().stat_loggers]


def call_update_engine_config(config: "EngineConfig") -> None:
    """Run every general plugin's ``kvloom_update_engine_config`` hook on ``config``."""
    load_plugins()
    assert _general is not None
    _general.update_engine_config(config)
