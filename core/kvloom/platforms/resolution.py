"""Platform resolution, beside the platform contract: which one installed platform is
active in this process.

Rules, in order:

1. ``KVLOOM_PLATFORM=name`` forces that platform; it must be installed, loaded (not
   excluded by ``KVLOOM_PLUGINS``) and available (an unavailable one is reported with
   its ``unavailable_reason()``).
2. Otherwise an available out-of-tree platform (``Platform.builtin`` False) wins over
   the built-in ones; two available out-of-tree platforms are an error naming both.
3. Otherwise an available built-in platform for an accelerator wins over the host CPU
   (device type "cpu"); two available built-in accelerator platforms are an error.
4. No available platform is an error listing every installed platform and saying which
   ones ``KVLOOM_PLUGINS`` left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvloom.platforms.interface import Platform
from kvloom_registry import PLUGINS_ENV, PluginEntry, PluginError, PluginLoadError

PLATFORM_ENV = "KVLOOM_PLATFORM"


class PlatformResolutionError(PluginError):
    """No platform, or more than one, could be made the active platform."""


def is_platform_available(entry: PluginEntry) -> bool:
    """``Platform.is_available()``, with a crash reported as the plugin's error."""
    platform: type[Platform] = entry.target
    try:
        return bool(platform.is_available())
    except Exception as exc:
        raise PluginLoadError.raised(entry, f"failed: {entry.value}.is_available() raised", exc) from exc


def unavailable_reason(entry: PluginEntry) -> str | None:
    """``Platform.unavailable_reason()``, with a crash reported as the plugin's error."""
    platform: type[Platform] = entry.target
    try:
        reason = platform.unavailable_reason()
    except Exception as exc:
        raise PluginLoadError.raised(entry, f"failed: {entry.value}.unavailable_reason() raised", exc) from exc
    return str(reason) if reason else None


def _names(entries: Sequence[PluginEntry], with_reasons: bool = False) -> str:
    def describe(e: PluginEntry) -> str:
        reason = unavailable_reason(e) if with_reasons else None
        return f"{e.name} ({e.distribution} {e.version}{': ' + reason if reason else ''})"

    return ", ".join(describe(e) for e in entries)


def _excluded_note(excluded: Sequence[PluginEntry]) -> str:
    if not excluded:
        return ""
    return (
        f" {PLUGINS_ENV} leaves out the installed platform plugins {', '.join(e.name for e in excluded)}; "
        f"add one of these names to {PLUGINS_ENV} to use it."
    )


def resolve_platform(
    platforms: Mapping[str, PluginEntry],
    forced: str | None = None,
    excluded: Sequence[PluginEntry] = (),
) -> PluginEntry:
    """The active platform among the loaded ``platforms`` (see the module docstring).

    ``forced`` is the value of ``KVLOOM_PLATFORM``; ``excluded`` are the platform
    plugins that ``KVLOOM_PLUGINS`` left out (for the error messages).
    """
    if forced:
        entry = platforms.get(forced)
        if entry is None:
            excluded_names = {e.name for e in excluded}
            why = (
                f"it is installed but {PLUGINS_ENV} does not list it"
                if forced in excluded_names
                else "no installed plugin provides it"
            )
            raise PlatformResolutionError(
                f"{PLATFORM_ENV}={forced}: {why}. Loaded platforms: "
                f"{', '.join(sorted(platforms)) or 'none'}."
            )
        if not is_platform_available(entry):
            reason = unavailable_reason(entry)
            raise PlatformResolutionError(
                f"{PLATFORM_ENV}={forced}: platform {forced} ({entry.distribution} {entry.version}) "
                f"is installed, but its is_available() returned False{': ' + reason if reason else ''}."
            )
        return entry

    available = [e for e in platforms.values() if is_platform_available(e)]
    out_of_tree = [e for e in available if not e.target.builtin]
    if len(out_of_tree) > 1:
        raise PlatformResolutionError(
            f"More than one out-of-tree platform is available: {_names(out_of_tree)}. "
            f"Set {PLATFORM_ENV} to one of {', '.join(e.name for e in out_of_tree)}, "
            "or uninstall the others."
        )
    if out_of_tree:
        return out_of_tree[0]
    accelerators = [e for e in available if e.target.device_type != "cpu"]
    if len(accelerators) > 1:
        raise PlatformResolutionError(
            f"More than one built-in accelerator platform is available: {_names(accelerators)}. "
            f"Set {PLATFORM_ENV} to one of {', '.join(e.name for e in accelerators)}."
        )
    if accelerators:
        return accelerators[0]
    if len(available) > 1:
        raise PlatformResolutionError(
            f"More than one built-in platform is available: {_names(available)}. "
            f"Set {PLATFORM_ENV} to one of {', '.join(e.name for e in available)}."
        )
    if available:
        return available[0]
    installed = (
        f"Installed platforms, none available here: {_names(list(platforms.values()), with_reasons=True)}."
        if platforms
        else "No platform plugin is loaded (install one, e.g. pip install kvloom-platform-cpu)."
    )
    raise PlatformResolutionError(f"No kvloom platform is available. {installed}{_excluded_note(excluded)}")
