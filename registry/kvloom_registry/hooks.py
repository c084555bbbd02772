"""General plugins: ``register()`` callables and pluggy hooks.

An entry point of a general-plugin group names one of:

- a function ``register()``: called once per process with no arguments;
- a module: its ``@hookimpl`` functions are registered with pluggy;
- a class: it is instantiated with no arguments and the instance's ``@hookimpl``
  methods are registered.

pluggy validates every hook implementation against the caller's spec class: an unknown
hook name or argument is an error at load time. A function whose name starts with the
hook prefix (``kvloom_``) but lacks the ``@hookimpl`` marker is also an error, because
pluggy would ignore it without a word.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import pluggy

from kvloom_registry.entry import PluginEntry
from kvloom_registry.errors import PluginLoadError, PluginTypeError

logger = logging.getLogger(__name__)


class HookPlugins:
    """The general plugins of a process and the pluggy manager that holds their hooks.

    ``project`` is pluggy's project name (the markers' name) and the prefix of every hook
    (``f"{project}_"``); ``spec`` is the class of ``@hookspec`` methods.
    """

    def __init__(self, project: str, spec: type) -> None:
        self._pm = pluggy.PluginManager(project)
        self._pm.add_hookspecs(spec)
        self._prefix = f"{project}_"
        self._entries: dict[str, PluginEntry] = {}  # pluggy plugin name -> entry

    def load(self, entries: Sequence[PluginEntry]) -> None:
        """Run every ``register()`` and register every hook plugin, in order."""
        for entry in entries:
            target = entry.target
            if inspect.ismodule(target) or inspect.isclass(target):
                self._register_hooks(entry, target)
            elif callable(target):
                self._run_register(entry, target)
            else:
                raise PluginTypeError(
                    f"{entry.describe()} names {entry.value} = {target!r}; a general plugin must "
                    "name a register() callable, a module or a class with @hookimpl functions"
                )

    def _run_register(self, entry: PluginEntry, register: Callable[[], object]) -> None:
        try:
            register()
        except Exception as exc:
            raise PluginLoadError.raised(entry, f"failed: running {entry.value}() raised", exc) from exc
        logger.debug("Ran %s", entry.describe())

    def _register_hooks(self, entry: PluginEntry, target: ModuleType | type) -> None:
        try:
            plugin = target() if inspect.isclass(target) else target
        except Exception as exc:
            raise PluginLoadError.raised(entry, f"failed: instantiating {entry.value} raised", exc) from exc
        try:
            self._pm.register(plugin, name=entry.name)
            # Hooks that match no spec are "pending"; there are no optional hooks, so a
            # pending hook is a misspelling.
            self._pm.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
            raise PluginLoadError.for_entry(
                entry,
                f"{entry.describe()} has an invalid hook implementation: {exc}",
            ) from exc
        registered = {
            impl.function.__name__
            for caller in self._pm.get_hookcallers(plugin) or []
            for impl in caller.get_hookimpls()
            if impl.plugin is plugin
        }
        unmarked = sorted(
            name
            for name, member in inspect.getmembers(plugin, callable)
            if name.startswith(self._prefix) and name not in registered and not inspect.isclass(member)
        )
        if unmarked or not registered:
            self._pm.unregister(plugin)
            hint = (
                f"{', '.join(unmarked)} lack the @kvloom.interfaces.hookimpl decorator"
                if unmarked
                else "it has no @kvloom.interfaces.hookimpl functions; name a register() callable "
                "(module:register) or decorate its hook functions"
            )
            raise PluginLoadError.for_entry(
                entry,
                f"{entry.describe()} names {entry.value}, but {hint}",
            )
        self._entries[entry.name] = entry
        logger.debug("Registered hooks %s of %s", sorted(registered), entry.describe())

    def call_hook(self, hook_name: str, **kwargs: Any) -> None:
        """Call one hook on every plugin that implements it, in registration order;
        an exception is reported with the plugin that raised it."""
        caller = getattr(self._pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            entry = self._entries[impl.plugin_name]
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception as exc:
                raise PluginLoadError.raised(entry, f"failed: its hook {hook_name} raised", exc) from exc
