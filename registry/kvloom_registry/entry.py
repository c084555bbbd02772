"""One plugin as the registry sees it: where it comes from, and what it loaded.

A module of its own, below both the loader that makes entries and the errors that name
them (``PluginLoadError.for_entry``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PluginEntry:
    """One plugin: where it comes from and (once loaded) what its entry point names."""

    name: str  # the entry-point name
    group: str
    distribution: str  # the pip distribution that declares the entry point
    version: str  # that distribution's version
    value: str  # the entry point's "module:attr" text
    target: Any = None  # the loaded object; None for plugins KVLOOM_PLUGINS excluded

    def describe(self) -> str:
        """How error messages name this plugin."""
        return f"plugin {self.name!r} (group {self.group}, distribution {self.distribution} {self.version})"
