"""The plugins of this process: kvloom's plugin groups, loaded once, then queried.

kvloom's hardware-specific parts and extensions are separate distributions that register
through entry points (``docs/plugins.md``). This module says which groups exist and what
each group's targets must be, has ``kvloom_registry`` load them, then does what the
plugins are for: registers LoRA resolvers, runs general plugins' ``register()`` and
registration hooks, and resolves the one active platform (``kvloom.platforms.resolution``).

Every accessor loads the plugins first, so callers never see a half-initialised state.
Loading is idempotent: the first call does the work, later calls return at once; if the
first call failed, every later call raises the same error (a process whose plugins
failed to load stays failed instead of running with some plugins missing). Plugins load
in every process that runs an engine.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import TypeVar

from kvloom.attention.backend import AttentionBackend
from kvloom.config import EngineConfig
from kvloom.entrypoint_plugin import EndpointPlugin
from kvloom.hookspecs import PROJECT_NAME, GeneralPluginSpec
from kvloom.io_processor import IOProcessor
from kvloom.kv_transfer.base import KVConnectorBase
from kvloom.logits_processor import LogitsProcessor
from kvloom.lora.resolver import LoRAResolver, LoRAResolverRegistry, _LoRAResolverRegistry
from kvloom.metrics.stat_logger_base import StatLoggerBase
from kvloom.models.registry import ModelRegistry, _ModelRegistry
from kvloom.platforms.interface import Platform
from kvloom.platforms.resolution import PLATFORM_ENV, resolve_platform
from kvloom.quantization.method import QuantizationMethod
from kvloom.reasoning.base import ReasoningParser
from kvloom.spec_decode.proposer import SpecDecodeProposer
from kvloom.structured_output.backend import StructuredOutputBackend
from kvloom.tool_parsers.base import ToolParser
from kvloom_registry import (
    PLUGINS_ENV,
    DuplicatePluginError,
    HookPlugins,
    LoadedPlugins,
    PluginEntry,
    PluginGroup,
    PluginLoadError,
    installed_entry_points,
    load_entry_points,
    parse_allowlist,
)

logger = logging.getLogger(__name__)

#: The plugin API version this kvloom provides. Plugins declare the version they target
#: in KVLOOM_PLUGIN_API; a different major version is refused.
PLUGIN_API_VERSION = "1.1"

ATTENTION_BACKENDS = "kvloom.attention_backends"
PLATFORM_PLUGINS = "kvloom.platform_plugins"
GENERAL_PLUGINS = "kvloom.general_plugins"
IO_PROCESSOR_PLUGINS = "kvloom.io_processor_plugins"
STAT_LOGGER_PLUGINS = "kvloom.stat_logger_plugins"
LORA_RESOLVERS = "kvloom.lora_resolvers"
STRUCTURED_OUTPUT_BACKENDS = "kvloom.structured_output_backends"
TOOL_PARSERS = "kvloom.tool_parsers"
REASONING_PARSERS = "kvloom.reasoning_parsers"
LOGITS_PROCESSORS = "kvloom.logits_processors"
ENDPOINT_PLUGINS = "kvloom.endpoint_plugins"
QUANTIZATION_METHODS = "kvloom.quantization_methods"
SPEC_DECODE_PROPOSERS = "kvloom.spec_decode_proposers"
KV_CONNECTORS = "kvloom.kv_connectors"

#: Every group kvloom reads, in loading order, with the contract of its targets.
GROUPS: tuple[PluginGroup, ...] = (
    PluginGroup(PLATFORM_PLUGINS, Platform, unique_names=True, name_attr="name", label="platforms"),
    PluginGroup(ATTENTION_BACKENDS, AttentionBackend, unique_names=True, name_attr="NAME", label="attention backends"),
    PluginGroup(GENERAL_PLUGINS, label="general plugins"),
    PluginGroup(IO_PROCESSOR_PLUGINS, IOProcessor, unique_names=True, label="IO processors"),
    PluginGroup(STAT_LOGGER_PLUGINS, StatLoggerBase, label="stat loggers"),
    PluginGroup(LORA_RESOLVERS, LoRAResolver, unique_names=True, label="LoRA resolvers"),
    PluginGroup(STRUCTURED_OUTPUT_BACKENDS, StructuredOutputBackend, unique_names=True, name_attr="name",
                label="structured-output backends"),  # fmt: skip
    PluginGroup(TOOL_PARSERS, ToolParser, unique_names=True, name_attr="name", label="tool parsers"),
    PluginGroup(REASONING_PARSERS, ReasoningParser, unique_names=True, name_attr="name", label="reasoning parsers"),
    PluginGroup(LOGITS_PROCESSORS, LogitsProcessor, unique_names=True, name_attr="name", label="logits processors"),
    # Routes widen what a server exposes: loaded only when KVLOOM_PLUGINS names them.
    PluginGroup(ENDPOINT_PLUGINS, EndpointPlugin, unique_names=True, name_attr="name", label="endpoint plugins",
                opt_in=True),
    PluginGroup(QUANTIZATION_METHODS, QuantizationMethod, unique_names=True, name_attr="NAME",
                label="quantization methods"),  # fmt: skip
    PluginGroup(SPEC_DECODE_PROPOSERS, SpecDecodeProposer, unique_names=True, name_attr="NAME",
                label="speculative-decoding proposers"),  # fmt: skip
    PluginGroup(KV_CONNECTORS, KVConnectorBase, unique_names=True, name_attr="NAME", label="KV connectors"),
)
ALL_GROUPS: tuple[str, ...] = tuple(group.name for group in GROUPS)

_lock = threading.RLock()
_loaded: LoadedPlugins | None = None
_hooks: HookPlugins | None = None
_failure: BaseException | None = None
_platform: PluginEntry | None = None


def _register_lora_resolvers(plugins: LoadedPlugins) -> None:
    for entry in plugins.group(LORA_RESOLVERS):
        try:
            resolver = entry.target()
        except Exception as exc:
            raise PluginLoadError.raised(entry, f"failed: instantiating {entry.value} raised", exc) from exc
        try:
            LoRAResolverRegistry.register_resolver(entry.name, resolver)
        except ValueError as exc:
            raise DuplicatePluginError(f"{entry.describe()}: {exc}") from exc


def run_general_plugins(
    entries: list[PluginEntry], model_registry: _ModelRegistry, resolver_registry: _LoRAResolverRegistry
) -> HookPlugins:
    """Run the general plugins' ``register()`` functions and register their hooks, then
    call the registration hooks with the registries they fill."""
    hooks = HookPlugins(PROJECT_NAME, GeneralPluginSpec)
    hooks.load(entries)
    hooks.call_hook("kvloom_register_models", model_registry=model_registry)
    hooks.call_hook("kvloom_register_lora_resolvers", resolver_registry=resolver_registry)
    return hooks


def load_plugins() -> None:
    """Discover and load every kvloom plugin of this process (idempotent)."""
    global _loaded, _hooks, _failure
    with _lock:
        if _loaded is not None:
            return
        if _failure is not None:
            raise _failure
        try:
            allowlist = parse_allowlist(os.environ.get(PLUGINS_ENV))
            plugins = load_entry_points(GROUPS, installed_entry_points(GROUPS), allowlist, PLUGIN_API_VERSION)
            _register_lora_resolvers(plugins)
            hooks = run_general_plugins(plugins.group(GENERAL_PLUGINS), ModelRegistry, LoRAResolverRegistry)
        except Exception as exc:
            _failure = exc
            raise
        _loaded, _hooks = plugins, hooks
        logger.debug(
            "kvloom plugins loaded: %s",
            "; ".join(f"{group}={[e.name for e in plugins.group(group)]}" for group in ALL_GROUPS),
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
    global _loaded, _hooks, _failure, _platform
    with _lock:
        _loaded = _hooks = _failure = _platform = None
        LoRAResolverRegistry.clear()


def set_platform_for_tests(entry: PluginEntry | None) -> PluginEntry | None:
    """Make ``entry`` the active platform (``None``: resolve it again on next use) and
    return the one it replaces (``None`` if none was resolved yet). Plugins load first.
    For ``kvloom.testing.active_platform``."""
    global _platform
    load_plugins()
    with _lock:
        previous, _platform = _platform, entry
        return previous


def excluded(group: str) -> list[PluginEntry]:
    """Installed plugins of ``group`` that ``KVLOOM_PLUGINS`` left out."""
    return list(loaded_plugins().excluded.get(group, []))


# ---------------------------------------------------------------------- attention backends


def attention_backends() -> dict[str, PluginEntry]:
    """Loaded attention backends: NAME -> entry (``.target`` is the class)."""
    return loaded_plugins().by_name(ATTENTION_BACKENDS)


# ---------------------------------------------------------------------- quantization methods


def quantization_methods() -> dict[str, type[QuantizationMethod]]:
    """Loaded quantization methods: NAME -> ``QuantizationMethod`` subclass."""
    return {name: entry.target for name, entry in loaded_plugins().by_name(QUANTIZATION_METHODS).items()}


# ---------------------------------------------------------------------- KV connectors


def kv_connectors() -> dict[str, type[KVConnectorBase]]:
    """Loaded KV connectors: NAME -> ``KVConnectorBase`` subclass."""
    return {name: entry.target for name, entry in loaded_plugins().by_name(KV_CONNECTORS).items()}


# ---------------------------------------------------------------------- platforms


def platforms() -> dict[str, PluginEntry]:
    """Loaded platforms: name -> entry (available or not)."""
    return loaded_plugins().by_name(PLATFORM_PLUGINS)


def current_platform_entry() -> PluginEntry:
    """The active platform's entry (resolved once per process)."""
    global _platform
    installed = platforms()
    with _lock:
        if _platform is None:
            _platform = resolve_platform(
                installed, forced=os.environ.get(PLATFORM_ENV) or None, excluded=excluded(PLATFORM_PLUGINS)
            )
            logger.debug("Active platform: %s (%s)", _platform.name, _platform.distribution)
        return _platform


def current_platform() -> type[Platform]:
    """The active platform class (see ``kvloom.platforms.resolution`` for the rules)."""
    return current_platform_entry().target


def get_platform_by_name(name: str) -> type[Platform]:
    """A loaded platform by name, available here or not (``kvloom backends --platform``)."""
    installed = platforms()
    if name not in installed:
        left_out = {e.name for e in excluded(PLATFORM_PLUGINS)}
        why = f"it is installed but {PLUGINS_ENV} does not list it" if name in left_out else "unknown platform"
        raise ValueError(f"Platform {name!r}: {why}. Loaded platforms: {', '.join(sorted(installed)) or 'none'}.")
    return installed[name].target


# ---------------------------------------------------------------------- other plugin kinds


def io_processor_plugins() -> dict[str, type[IOProcessor]]:
    return {name: entry.target for name, entry in loaded_plugins().by_name(IO_PROCESSOR_PLUGINS).items()}


def get_io_processor_cls(name: str) -> type[IOProcessor]:
    processors = io_processor_plugins()
    if name not in processors:
        raise ValueError(
            f"io_processor_plugin: no IO processor plugin named {name!r} is loaded "
            f"(installed: {', '.join(sorted(processors)) or 'none'})"
        )
    return processors[name]


def stat_logger_plugins() -> list[PluginEntry]:
    """Loaded stat loggers (``.target`` is the ``StatLoggerBase`` subclass), by name."""
    return loaded_plugins().group(STAT_LOGGER_PLUGINS)


def call_update_engine_config(config: EngineConfig) -> None:
    """Run every general plugin's ``kvloom_update_engine_config`` hook on ``config``."""
    load_plugins()
    assert _hooks is not None
    _hooks.call_hook("kvloom_update_engine_config", config=config)


def with_built_ins(built_in: dict[str, type], group: str, kind: str) -> dict[str, type]:
    """Name -> class for a plugin kind that kvloom also ships built-in implementations of
    (structured-output backends, tool parsers): ``built_in`` plus the loaded plugins of
    ``group``; a plugin may not reuse a built-in name (``kind`` names it in the error)."""
    merged = dict(built_in)
    for name, entry in loaded_plugins().by_name(group).items():
        if name in merged:
            raise ValueError(f"{entry.describe()}: the {kind} {name!r} is built in")
        merged[name] = entry.target
    return merged


_T = TypeVar("_T")


def pick_by_name(table: Mapping[str, _T], name: str, option: str, kind: str) -> _T:
    """``table[name]``; else a ``ValueError`` naming the ``option`` (flag or field) that
    asked for it, the unknown ``kind`` and the available names."""
    if name not in table:
        raise ValueError(f"{option}: unknown {kind} {name!r} (available: {', '.join(sorted(table))})")
    return table[name]


def structured_output_backends(built_in: dict[str, type]) -> dict[str, type]:
    """Structured-output backends: name -> ``StructuredOutputBackend`` subclass, the
    built-in ones (``built_in``: ``xgrammar``) and the loaded plugins."""
    return with_built_ins(built_in, STRUCTURED_OUTPUT_BACKENDS, "structured-output backend")


def tool_parsers(built_in: dict[str, type]) -> dict[str, type]:
    """Tool-call parsers: name -> ``ToolParser`` subclass, the built-in ones (``built_in``:
    ``hermes``, ``llama3_json``) and the loaded plugins."""
    return with_built_ins(built_in, TOOL_PARSERS, "tool parser")


def reasoning_parsers(built_in: dict[str, type]) -> dict[str, type]:
    """Reasoning parsers: name -> ``ReasoningParser`` subclass, the built-in ones (``built_in``:
    ``deepseek_r1``, ``qwen3``) and the loaded plugins."""
    return with_built_ins(built_in, REASONING_PARSERS, "reasoning parser")


def spec_decode_proposers(built_in: dict[str, type]) -> dict[str, type]:
    """Speculative-decoding proposers: NAME -> ``SpecDecodeProposer`` subclass, the built-in
    ones (``built_in``: ``ngram``, ``draft_model``, ``eagle3``, ``mtp``) and the loaded plugins."""
    return with_built_ins(built_in, SPEC_DECODE_PROPOSERS, "speculative-decoding proposer")


def logits_processors() -> dict[str, type]:
    """Logits processors: name -> ``LogitsProcessor`` subclass (plugins only; none built in)."""
    return {name: entry.target for name, entry in loaded_plugins().by_name(LOGITS_PROCESSORS).items()}


def endpoint_plugins() -> list[PluginEntry]:
    """Loaded endpoint plugins (``.target`` is the ``EndpointPlugin`` subclass): only those
    ``KVLOOM_PLUGINS`` names."""
    return loaded_plugins().group(ENDPOINT_PLUGINS)
