"""Attention backend selection, beside the backend contract: the platform's priority
order, every candidate validated, first valid wins.

Candidates, highest priority first:

1. The backends the platform lists for (MLA or not, device capability), in its order;
   for an MLA model's prefill phase (``config.mla_phase == "prefill"``) the platform's
   ``get_mla_prefill_backend_priority``. An MLA model is selected twice, once per phase
   (decode: ``--attention-backend``, prefill: ``--mla-prefill-backend``).
   A listed backend that no loaded plugin provides is still a candidate, invalid with
   the reason "not installed (pip install <provider>)" (or "KVLOOM_PLUGINS does not
   list it" when it is installed but was left out).
2. Every other installed backend (out-of-tree backends the platform does not know), by
   name. They rank below the platform's list, so any number of them can coexist and one
   of them is chosen when nothing the platform lists is valid.

An explicitly requested backend is validated the same way; if it is invalid, selection
fails with its reasons and never falls back to another backend.

Measured order (``attention/tuning.py``): where ``kvloom backends tune`` cached a tune for
this device and configuration, the valid candidates it measured come first, fastest
first, then the others in the order above; each report carries its measured time. An
explicitly requested backend is never replaced by a faster one.

Block size (docs/attention_backends.md): a block size the user set is part of the
configuration, so a backend that cannot serve it is invalid with a reason naming the sizes
it accepts ("block size 16 not supported (supports multiples of 256)") and selection moves
on. Without one, no backend is rejected for its block sizes, and the selected backend
decides the size (``AttentionBackend.preferred_block_size``): ``SelectionResult.block_size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvloom_registry import PLUGINS_ENV, PluginEntry, PluginLoadError

from kvloom import plugins
from kvloom.attention.backend import AttentionBackend, AttentionSelectorConfig, dtype_name
from kvloom.attention.tuning import BackendTune, find_tune
from kvloom.platforms.interface import Platform


class BackendSelectionError(ValueError):
    """No attention backend can serve the configuration, or the requested one cannot.

    A ``ValueError`` because it is caused by the user's configuration (model, dtype,
    block size, requested backend), not by a broken plugin.
    """


@dataclass(frozen=True)
class CandidateReport:
    """One row of the priority table."""

    name: str
    priority: int  # 1 = tried first
    valid: bool
    reasons: tuple[str, ...]  # empty when valid
    distribution: str | None  # the providing distribution (the one to install, if missing)
    version: str | None  # None when not installed
    installed: bool  # a loaded plugin provides it
    excluded: bool = False  # installed, but KVLOOM_PLUGINS left it out
    measured_ms: float | None = None  # its score in the tune that ordered the candidates, if any

    @property
    def status(self) -> str:
        """"valid", "invalid", "excluded" (by KVLOOM_PLUGINS) or "not installed"."""
        if self.installed:
            return "valid" if self.valid else "invalid"
        return "excluded" if self.excluded else "not installed"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "priority": self.priority,
            "valid": self.valid,
            "reasons": list(self.reasons),
            "distribution": self.distribution,
            "version": self.version,
            "measured_ms": self.measured_ms,
        }


@dataclass(frozen=True)
class SelectionResult:
    """The selected backend class, the whole priority table, and the block size the
    engine will use with it (the user's, or the backend's preferred one)."""

    selected: type[AttentionBackend]
    candidates: list[CandidateReport]
    block_size: int
    tune: BackendTune | None = None  # the measurement that ordered the candidates, if any


@dataclass(frozen=True)
class SelectionReport:
    """What ``kvloom backends`` shows; ``error`` is set instead of raising."""

    platform: str
    config: AttentionSelectorConfig
    selected: str | None
    candidates: list[CandidateReport]
    block_size: int | None
    error: str | None = None
    requested: str | None = None
    tune: BackendTune | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "selected": self.selected,
            "block_size": self.block_size,
            "order": "tune" if self.tune is not None else "platform",
            "tune_created": self.tune.created if self.tune is not None else None,
            "candidates": [c.to_json() for c in self.candidates],
        }


def describe_config(platform: type[Platform], config: AttentionSelectorConfig) -> str:
    capability = config.device_capability if config.device_capability is not None else "n/a"
    return (
        f"platform {platform.name} (device {config.device_type}, capability {capability}): "
        f"head_size={config.head_size}, dtype={dtype_name(config.dtype)}, "
        f"kv_cache_dtype={config.kv_cache_dtype}, "
        f"block_size={config.block_size if config.block_size is not None else 'auto'}, "
        f"use_mla={config.use_mla}, attn_type={config.attn_type.value}"
        + (f", mla_phase={config.mla_phase}" if config.mla_phase is not None else "")
    )


def _validate(entry: PluginEntry, config: AttentionSelectorConfig) -> list[str]:
    backend: type[AttentionBackend] = entry.target
    try:
        return [str(r) for r in backend.validate_configuration(config)]
    except Exception as exc:
        # A crash in validation is a bug in the plugin; hiding it as a "reason" would
        # make the backend silently unselectable.
        raise PluginLoadError.raised(
            entry, f"failed: {backend.__qualname__}.validate_configuration raised", exc
        ) from exc


def rank_candidates(
    platform: type[Platform],
    config: AttentionSelectorConfig,
    installed: Mapping[str, PluginEntry],
    excluded: Sequence[PluginEntry] = (),
    tune: BackendTune | None = None,
) -> list[CandidateReport]:
    """Every candidate in priority order, each validated; with ``tune``, the valid ones it
    measured first, fastest first (see the module docstring)."""
    order: dict[str, str | None] = {}  # name -> provider (None: not in the platform's list)
    if config.use_mla and config.mla_phase == "prefill":
        listed = platform.get_mla_prefill_backend_priority(config.device_capability)
    else:
        listed = platform.get_attn_backend_priority(config.use_mla, config.device_capability)
    for candidate in listed:
        order.setdefault(candidate.name, candidate.provider)
    excluded_by_name = {e.name: e for e in excluded}
    for name in sorted(set(installed) | set(excluded_by_name)):
        order.setdefault(name, None)

    reports = []
    for priority, (name, provider) in enumerate(order.items(), start=1):
        entry = installed.get(name)
        if entry is not None:
            reasons = _validate(entry, config)
            reports.append(
                CandidateReport(name, priority, not reasons, tuple(reasons), entry.distribution, entry.version, True)
            )
        elif name in excluded_by_name:
            ex = excluded_by_name[name]
            reason = f"installed ({ex.distribution} {ex.version}) but {PLUGINS_ENV} does not list it"
            reports.append(
                CandidateReport(name, priority, False, (reason,), ex.distribution, ex.version, False, excluded=True)
            )
        else:
            reason = f"not installed (pip install {provider})"
            reports.append(CandidateReport(name, priority, False, (reason,), provider, None, False))
    return reports if tune is None else order_by_tune(reports, tune)


def order_by_tune(reports: list[CandidateReport], tune: BackendTune) -> list[CandidateReport]:
    """``reports`` (in platform order) with the valid candidates ``tune`` measured first,
    fastest first, then the rest in their order; priorities renumbered, times attached."""
    times = {name: tune.total_ms(name) for name in (r.name for r in reports)}
    measured = sorted((r for r in reports if r.valid and times[r.name] is not None), key=lambda r: times[r.name])
    rest = [r for r in reports if not (r.valid and times[r.name] is not None)]
    return [dataclasses.replace(r, priority=i, measured_ms=times[r.name])
            for i, r in enumerate([*measured, *rest], start=1)]  # fmt: skip


def _unknown_backend_message(
    requested: str, candidates: list[CandidateReport], installed: Mapping[str, PluginEntry]
) -> str:
    known = ", ".join(sorted(installed)) or "none"
    listed = next((c for c in candidates if c.name == requested), None)
    if listed is not None:  # a candidate, but no loaded plugin provides it
        return f"Attention backend {requested} is {listed.reasons[0]}. Valid names: {known}."
    return f"Unknown attention backend {requested!r}. Valid names: {known}."


def _no_valid_message(
    platform: type[Platform], config: AttentionSelectorConfig, candidates: list[CandidateReport]
) -> str:
    lines = [
        f"No valid attention backend found for {describe_config(platform, config)}. "
        "Candidates in priority order:"
    ]
    for c in candidates:
        lines.append(f"  {c.priority}. {c.name} ({c.distribution}): {'; '.join(c.reasons)}")
    return "\n".join(lines)


def select_backend(
    platform: type[Platform],
    config: AttentionSelectorConfig,
    requested: str | None,
    installed: Mapping[str, PluginEntry],
    excluded: Sequence[PluginEntry] = (),
    tune: BackendTune | None = None,
) -> SelectionResult:
    """Select a backend; raises ``BackendSelectionError`` (a ``ValueError``) when the
    requested backend is unknown or invalid, or when no candidate is valid. ``tune``
    orders the valid candidates by measurement (never overriding ``requested``)."""
    candidates = rank_candidates(platform, config, installed, excluded, tune)
    if requested is not None:
        if requested not in installed:
            raise BackendSelectionError(_unknown_backend_message(requested, candidates, installed))
        report = next(c for c in candidates if c.name == requested)
        if not report.valid:
            raise BackendSelectionError(
                f"Selected backend {requested} is not valid for this configuration. "
                f"Reasons: {list(report.reasons)!r}"
            )
        chosen = installed[requested].target
    else:
        first_valid = next((c for c in candidates if c.valid), None)
        if first_valid is None:
            raise BackendSelectionError(_no_valid_message(platform, config, candidates))
        chosen = installed[first_valid.name].target
    block_size = config.block_size if config.block_size is not None else chosen.preferred_block_size()
    return SelectionResult(selected=chosen, candidates=candidates, block_size=block_size, tune=tune)


def report_backends(
    platform: type[Platform],
    config: AttentionSelectorConfig,
    requested: str | None,
    installed: Mapping[str, PluginEntry],
    excluded: Sequence[PluginEntry] = (),
    tune: BackendTune | None = None,
) -> SelectionReport:
    """Like ``select_backend`` but a selection failure is returned in ``error``."""
    try:
        result = select_backend(platform, config, requested, installed, excluded, tune)
    except BackendSelectionError as exc:
        return SelectionReport(
            platform=platform.name,
            config=config,
            selected=None,
            candidates=rank_candidates(platform, config, installed, excluded, tune),
            block_size=None,
            error=str(exc),
            requested=requested,
            tune=tune,
        )
    return SelectionReport(
        platform=platform.name,
        config=config,
        selected=result.selected.NAME,
        candidates=result.candidates,
        block_size=result.block_size,
        requested=requested,
        tune=tune,
    )


# ---------------------------------------------------------------------- over the loaded plugins


def _installed(backends: Mapping[str, PluginEntry] | None) -> tuple[Mapping[str, PluginEntry], list[PluginEntry]]:
    if backends is not None:  # injected (tests, tools): no process state involved
        return backends, []
    return plugins.attention_backends(), plugins.excluded(plugins.ATTENTION_BACKENDS)


def _tune(
    platform: type[Platform], config: AttentionSelectorConfig, backends: Mapping[str, PluginEntry] | None,
    tune: BackendTune | None,
) -> BackendTune | None:
    """The tune that orders the candidates: the one given, else over the loaded plugins the
    cached one for this device and configuration (none for injected backends)."""
    if tune is not None or backends is not None:
        return tune
    return find_tune(platform, config)


def select_attention_backend(
    platform: type[Platform],
    selector_config: AttentionSelectorConfig,
    requested: str | None = None,
    *,
    backends: Mapping[str, PluginEntry] | None = None,
    tune: BackendTune | None = None,
) -> SelectionResult:
    """Pick the attention backend for ``selector_config`` on ``platform`` among the loaded
    backends (or ``backends``, NAME -> entry, when given). ``requested`` is the user's
    ``attention_backend`` (None = by priority: by the cached tune of this device when
    there is one, or by ``tune``). Raises ``BackendSelectionError`` (a ``ValueError``) with
    every reason."""
    installed, excluded = _installed(backends)
    return select_backend(platform, selector_config, requested, installed, excluded,
                          _tune(platform, selector_config, backends, tune))  # fmt: skip


def report_attention_backends(
    platform: type[Platform],
    selector_config: AttentionSelectorConfig,
    requested: str | None = None,
    *,
    backends: Mapping[str, PluginEntry] | None = None,
    tune: BackendTune | None = None,
) -> SelectionReport:
    """The priority table and the selection outcome, without raising on selection errors."""
    installed, excluded = _installed(backends)
    return report_backends(platform, selector_config, requested, installed, excluded,
                           _tune(platform, selector_config, backends, tune))  # fmt: skip


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The loaded backend class a NAME stands for, for tools (``kvloom backends test NAME``,
    the kernel benchmarks). The engine never calls this: it keeps the class selection gave it."""
    backends = plugins.attention_backends()
    if name not in backends:
        raise BackendSelectionError(
            f"Unknown attention backend {name!r}. Valid names: {', '.join(sorted(backends)) or 'none'}."
        )
    return backends[name].target
