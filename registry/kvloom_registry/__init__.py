"""kvloom_registry: kvloom's plugin machinery, apart from the engine.

It finds entry points (``importlib.metadata``), loads them under the policy of
``KVLOOM_PLUGINS``, checks each one's ``KVLOOM_PLUGIN_API`` and the contract of its group,
reports every failure with the plugin's name, group, distribution and traceback, and runs
general plugins' ``register()`` functions and pluggy hooks.

It knows nothing of the engine: which groups exist, which base class each group's
targets must subclass and which API version is current are given by the caller
(``kvloom.plugins``). Dependencies run one way: kvloom imports this package, never the
reverse.
"""

from kvloom_registry.entry import PluginEntry
from kvloom_registry.errors import (
    DuplicatePluginError,
    PluginAllowlistError,
    PluginAPIVersionError,
    PluginError,
    PluginLoadError,
    PluginTypeError,
)
from kvloom_registry.hooks import HookPlugins
from kvloom_registry.loader import (
    API_VERSION_ATTR,
    PLUGINS_ENV,
    LoadedPlugins,
    PluginGroup,
    check_plugin_api,
    installed_entry_points,
    load_entry_points,
    parse_allowlist,
)

__all__ = [
    "API_VERSION_ATTR",
    "DuplicatePluginError",
    "HookPlugins",
    "LoadedPlugins",
    "PLUGINS_ENV",
    "PluginAPIVersionError",
    "PluginAllowlistError",
    "PluginEntry",
    "PluginError",
    "PluginGroup",
    "PluginLoadError",
    "PluginTypeError",
    "check_plugin_api",
    "installed_entry_points",
    "load_entry_points",
    "parse_allowlist",
]
