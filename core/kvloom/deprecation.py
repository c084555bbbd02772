"""Deprecated names of the plugin API: an old name keeps working for a while, and says so.

When a name that plugins use is renamed, the old one stays as an alias until the plugin API
version named in its ``Deprecation`` (at least one minor version later: docs/plugins.md,
"Compatibility"). Reading it gives what the new name gives, and the first read in a process
warns: a ``DeprecationWarning`` (which test runs show, pointing at the plugin's line) and a
log line (which every run shows), both naming the new name and the version that removes the
old one. The face record (``kvloom/interfaces/face.json``, written by
``python -m kvloom.testing.face --write``) lists every deprecated name with that version; the
face test refuses to drop one earlier.

Three kinds of alias: ``deprecated_property`` (an attribute of a class, e.g. a renamed config
field), ``deprecated_method`` (a method kept beside its replacement, e.g. the worker's 1.0 step
verbs) and ``deprecated_attributes`` (a module's ``__getattr__``, e.g. a name that left
``kvloom.interfaces``). A deprecation that is no name (an old return type or signature still
accepted) warns through ``Deprecation.warn`` where the engine meets it.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_warned: set[str] = set()
_lock = threading.Lock()


@dataclass(frozen=True)
class Deprecation:
    """One deprecated name: how plugins wrote it, what to write instead, when it goes."""

    old: str  # as a plugin writes it: "config.attention_backend"
    new: str  # what to write instead: "config.attention.backend"
    goes_in: str  # the plugin API version ("MAJOR.MINOR") that no longer has ``old``

    def message(self) -> str:
        return f"{self.old} is deprecated: use {self.new}. kvloom plugin API {self.goes_in} removes {self.old}."

    def warn(self, stacklevel: int = 3) -> None:
        """Warn the first time this name is used in the process; later uses are silent."""
        with _lock:
            if self.old in _warned:
                return
            _warned.add(self.old)
        warnings.warn(self.message(), DeprecationWarning, stacklevel=stacklevel)
        logger.warning("%s", self.message())


def reset_warnings_for_tests() -> None:
    """Forget which deprecated names have warned, so the next use warns again."""
    with _lock:
        _warned.clear()


def deprecated_property(deprecation: Deprecation, getter: Callable[[Any], Any]) -> property:
    """A read-only property that warns (once) and returns ``getter(self)``.

    The property's getter carries the ``Deprecation`` as ``.deprecation`` (the face record
    reads it there)."""

    def get(self: Any) -> Any:
        deprecation.warn()
        return getter(self)

    get.__doc__ = f"Deprecated: use ``{deprecation.new}`` (plugin API {deprecation.goes_in} removes it)."
    get.deprecation = deprecation  # type: ignore[attr-defined]
    return property(get)


def deprecated_method(deprecation: Deprecation) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method as a deprecated alias: calling it warns (once), then runs it. The
    wrapper carries the ``Deprecation`` as ``.deprecation`` (the face record reads it there)."""

    def mark(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def alias(*args: Any, **kwargs: Any) -> Any:
            deprecation.warn()
            return method(*args, **kwargs)

        alias.deprecation = deprecation  # type: ignore[attr-defined]
        return alias

    return mark


def deprecated_attributes(
    module: str, aliases: Mapping[str, tuple[Deprecation, Callable[[], object]]]
) -> Callable[[str], object]:
    """A module ``__getattr__`` serving deprecated names: ``aliases`` maps each old name to
    its ``Deprecation`` and a function returning the value (called on each use, so that the
    value's module is imported only when a plugin still uses the old name). Other names raise
    ``AttributeError`` as usual. Assign it: ``__getattr__ = deprecated_attributes(__name__, {...})``;
    the returned function carries ``.deprecations`` (old name -> ``Deprecation``) for the face
    record."""

    def __getattr__(name: str) -> object:
        if name not in aliases:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        deprecation, value = aliases[name]
        deprecation.warn()
        return value()

    __getattr__.deprecations = {name: d for name, (d, _) in aliases.items()}  # type: ignore[attr-defined]
    return __getattr__
