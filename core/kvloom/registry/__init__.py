"""kvloom.registry: plugin discovery, loading policy, platform resolution and backend selection.

kvloom's hardware-specific parts and extensions are separate distributions that
register through entry points (see ``docs/plugins.md``). This package finds them with
``importlib.metadata``, loads them under the policy of ``KVLOOM_PLUGINS``, checks each
one's ``KVLOOM_PLUGIN_API``, picks the one active platform (``KVLOOM_PLATFORM``) and
selects the attention backend in the platform's priority order.

Modules: ``loader`` (discovery, policy, checks), ``general`` (register() callables and
pluggy hooks), ``platforms`` (platform resolution), ``selection`` (backend selection),
``state`` (this process's loaded plugins and the accessors re-exported here).
"""

from kvloom.registry.errors import (
    BackendSelectionError,
    DuplicatePluginError,
    PlatformResolutionError,
    PluginAllowlistError,
    PluginAPIVersionError,
    PluginError,
    PluginLoadError,
    PluginTypeError,
)
from kvloom.registry.loader import (
    ALL_GROUPS,
    ATTENTION_BACKENDS,
    GENERAL_PLUGINS,
    IO_PROCESSOR_PLUGINS,
    LORA_RESOLVERS,
    PLATFORM_PLUGINS,
    PLUGINS_ENV,
    STAT_LOGGER_PLUGINS,
    PluginEntry,
)
from kvloom.registry.platforms import PLATFORM_ENV
from kvloom.registry.selection import CandidateReport, SelectionReport, SelectionResult
from kvloom.registry.state import (
    attention_backends,
    call_update_engine_config,
    current_platform,
    current_platform_entry,
    get_attention_backend,
    get_io_processor_cls,
    get_platform_by_name,
    io_processor_plugins,
    load_plugins,
    loaded_plugins,
    platforms,
    report_attention_backends,
    reset_for_tests,
    select_attention_backend,
    stat_logger_classes,
)

__all__ = [
    "ALL_GROUPS",
    "ATTENTION_BACKENDS",
    "BackendSelectionError",
    "CandidateReport",
    "DuplicatePluginError",
    "GENERAL_PLUGINS",
    "IO_PROCESSOR_PLUGINS",
    "LORA_RESOLVERS",
    "PLATFORM_ENV",
    "PLATFORM_PLUGINS",
    "PLUGINS_ENV",
    "PlatformResolutionError",
    "PluginAPIVersionError",
    "PluginAllowlistError",
    "PluginEntry",
    "PluginError",
    "PluginLoadError",
    "PluginTypeError",
    "STAT_LOGGER_PLUGINS",
    "SelectionReport",
    "SelectionResult",
    "attention_backends",
    "call_update_engine_config",
    "current_platform",
    "current_platform_entry",
    "get_attention_backend",
    "get_io_processor_cls",
    "get_platform_by_name",
    "io_processor_plugins",
    "load_plugins",
    "loaded_plugins",
    "platforms",
    "report_attention_backends",
    "reset_for_tests",
    "select_attention_backend",
    "stat_logger_classes",
]
