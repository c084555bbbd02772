"""Deprecated names of the plugin face: each warns once per process, then works.

The plugin-API compatibility rule (``docs/plugins.md``, "Compatibility"): a rename keeps
the old name as a deprecated alias for one minor version; a removal or an incompatible
change bumps the major version. ``warn_deprecated`` is how an alias says so.
"""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def warn_deprecated(old: str, new: str, since: str, removed_in: str) -> None:
    """Warn (a ``DeprecationWarning`` and a log line) the first time ``old`` is used in this
    process: it is deprecated since plugin API ``since`` and goes in ``removed_in``."""
    if old in _warned:
        return
    _warned.add(old)
    message = f"{old} is deprecated since kvloom plugin API {since} and goes in {removed_in}; use {new}"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    logger.warning(message)
