"""Errors raised while discovering and loading plugins.

Every message names what went wrong, which plugin (entry-point name, group,
distribution) it concerns and what the user can do about it: plugin problems are
never skipped silently.
"""

from __future__ import annotations

import traceback

from kvloom_registry.entry import PluginEntry


class PluginError(RuntimeError):
    """Base class of the registry's plugin errors."""


class PluginLoadError(PluginError):
    """A plugin raised while it was imported or initialised.

    The message carries the plugin's name, group, distribution and the traceback text
    (also available as ``traceback_text``).
    """

    def __init__(
        self, message: str, *, plugin: str, group: str, distribution: str, traceback_text: str = ""
    ) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.group = group
        self.distribution = distribution
        self.traceback_text = traceback_text

    @classmethod
    def for_entry(cls, entry: PluginEntry, message: str, traceback_text: str = "") -> PluginLoadError:
        """The error for one discovered entry point (its name, group and distribution)."""
        return cls(
            message,
            plugin=entry.name,
            group=entry.group,
            distribution=entry.distribution,
            traceback_text=traceback_text,
        )

    @classmethod
    def raised(cls, entry: PluginEntry, what: str, exc: BaseException) -> PluginLoadError:
        """The error for a plugin whose code raised ``exc`` (call it in the ``except``
        block: the current traceback goes into the message). ``what`` says what was being
        done, e.g. ``"failed: Backend.validate_configuration raised"``."""
        tb = traceback.format_exc()
        return cls.for_entry(entry, f"{entry.describe()} {what} {type(exc).__name__}: {exc}\n{tb}", tb)


class PluginAPIVersionError(PluginError):
    """A plugin declares no ``KVLOOM_PLUGIN_API`` or an incompatible one."""


class PluginTypeError(PluginError, TypeError):
    """A plugin's entry point names an object of the wrong kind (e.g. a stat logger
    that is not a ``StatLoggerBase`` subclass)."""


class PluginAllowlistError(PluginError):
    """``KVLOOM_PLUGINS`` names a plugin that no installed distribution provides."""


class DuplicatePluginError(PluginError):
    """Two plugins claim the same name in a group where names must be unique."""
