"""Plugins in a test: load them afresh, make a backend, platform or quantization method
class look installed (or the installed methods absent), and see what attention backend
selection would do.

Everything here acts on this process's plugins only (what ``LLM``, the engine's config
and ``run_cli`` see in this process), never on what is pip-installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from kvloom import plugins
from kvloom.attention import selector
from kvloom.attention.backend import AttentionBackend, AttentionSelectorConfig
from kvloom.platforms.interface import Platform
from kvloom.quantization.method import QuantizationMethod
from kvloom.spec_decode.proposer import SpecDecodeProposer
from kvloom_registry import PluginEntry

__all__ = [
    "active_platform",
    "fresh_plugins",
    "installed_backend",
    "installed_proposer",
    "installed_quantization_methods",
    "report_attention_backends",
    "select_attention_backend",
]


def _entry(group: str, name: str, target: type, distribution: str | None, version: str) -> PluginEntry:
    if distribution is None:  # the top-level package, as pip spells distributions
        distribution = target.__module__.split(".")[0].replace("_", "-")
    return PluginEntry(name, group, distribution, version, f"{target.__module__}:{target.__qualname__}", target)


@contextmanager
def _added(entry: PluginEntry) -> Iterator[None]:
    """``entry`` among the loaded plugins of its group (replacing one of the same name)
    for the block; the group as it was afterwards."""
    loaded = plugins.loaded_plugins()
    before = loaded.group(entry.group)
    loaded.entries[entry.group] = sorted([*(e for e in before if e.name != entry.name), entry], key=lambda e: e.name)
    try:
        yield
    finally:
        loaded.entries[entry.group] = before


@contextmanager
def fresh_plugins() -> Iterator[None]:
    """Forget this process's loaded plugins on entering and on leaving the block: the code
    inside loads them afresh, under the ``KVLOOM_PLUGINS`` and ``KVLOOM_PLATFORM`` the test
    set (``monkeypatch.setenv``), and the next test starts clean. A cached plugin load
    failure and the resolved platform are forgotten too."""
    plugins.reset_for_tests()
    try:
        yield
    finally:
        plugins.reset_for_tests()


@contextmanager
def installed_backend(
    backend: type[AttentionBackend], *, distribution: str | None = None, version: str = "0.0.0"
) -> Iterator[type[AttentionBackend]]:
    """Inside the block, ``backend`` is a loaded attention backend, as if its distribution
    declared it as a ``kvloom.attention_backends`` entry point named ``backend.NAME``
    (replacing an installed one of that name): selection, ``LLM``, ``resolve_engine_config``
    and ``run_cli(["backends", ...])`` see it, ranked as the platform's priority list says.
    ``distribution`` (default: the backend's top-level package name with ``-`` for ``_``)
    and ``version`` are what reports show. Plugins load first if they have not; nest the
    block in ``fresh_plugins()`` to load them under the test's environment. Yields
    ``backend``."""
    with _added(_entry(plugins.ATTENTION_BACKENDS, backend.NAME, backend, distribution, version)):
        yield backend


@contextmanager
def active_platform(
    platform: type[Platform], *, distribution: str | None = None, version: str = "0.0.0"
) -> Iterator[type[Platform]]:
    """Inside the block, ``platform`` is this process's active platform and the loaded
    platform named ``platform.name`` (replacing an installed one of that name): ``LLM``,
    ``resolve_engine_config`` and ``run_cli`` use it, e.g. a subclass of your platform that
    reports a simulated device (``is_available``, ``get_device_capability``). The platform
    that was active before is restored afterwards. ``distribution`` and ``version`` as for
    ``installed_backend``. Yields ``platform``."""
    entry = _entry(plugins.PLATFORM_PLUGINS, platform.name, platform, distribution, version)
    with _added(entry):
        previous = plugins.set_platform_for_tests(entry)
        try:
            yield platform
        finally:
            plugins.set_platform_for_tests(previous)


@contextmanager
def installed_proposer(
    proposer: type[SpecDecodeProposer], *, distribution: str | None = None, version: str = "0.0.0"
) -> Iterator[type[SpecDecodeProposer]]:
    """Inside the block, ``proposer`` is a loaded speculative-decoding proposer, as if its
    distribution declared it as a ``kvloom.spec_decode_proposers`` entry point named
    ``proposer.NAME``: ``LLM(speculative_config={"method": NAME, ...})`` runs it.
    ``distribution`` and ``version`` as for ``installed_backend``. Yields ``proposer``."""
    with _added(_entry(plugins.SPEC_DECODE_PROPOSERS, proposer.NAME, proposer, distribution, version)):
        yield proposer


@contextmanager
def installed_quantization_methods(*methods: type[QuantizationMethod]) -> Iterator[None]:
    """Inside the block, ``methods`` (classes) are this process's quantization methods and
    no others, as if their distributions alone declared ``kvloom.quantization_methods``
    entry points (none: no method installed, to see what a user without the package
    sees). Plugins load first if they have not."""
    loaded = plugins.loaded_plugins()
    group = plugins.QUANTIZATION_METHODS
    before = loaded.group(group)
    loaded.entries[group] = sorted((_entry(group, m.NAME, m, None, "0.0.0") for m in methods), key=lambda e: e.name)
    try:
        yield
    finally:
        loaded.entries[group] = before


def _backends(backends: Iterable[type[AttentionBackend]] | None) -> dict[str, PluginEntry] | None:
    if backends is None:
        return None
    return {b.NAME: _entry(plugins.ATTENTION_BACKENDS, b.NAME, b, None, "0.0.0") for b in backends}


def select_attention_backend(
    platform: type[Platform],
    config: AttentionSelectorConfig,
    requested: str | None = None,
    *,
    backends: Iterable[type[AttentionBackend]] | None = None,
) -> selector.SelectionResult:
    """The engine's attention backend selection for ``config`` on ``platform``, among
    ``backends`` (classes; default: the loaded backends) as if they alone were installed.
    ``requested`` is the user's ``attention_backend`` (``None``: by the platform's
    priority). Returns ``.selected`` (the class), ``.block_size`` (the user's, or the
    selected backend's preferred one) and ``.candidates`` (every candidate in priority
    order, with ``.name``, ``.valid`` and ``.reasons``). Raises a ``ValueError`` with every
    reason when nothing is valid or the requested backend is not."""
    return selector.select_attention_backend(platform, config, requested, backends=_backends(backends))


def report_attention_backends(
    platform: type[Platform],
    config: AttentionSelectorConfig,
    requested: str | None = None,
    *,
    backends: Iterable[type[AttentionBackend]] | None = None,
) -> selector.SelectionReport:
    """What ``kvloom backends`` shows, as ``select_attention_backend`` but without raising:
    ``.selected`` (a NAME or ``None``), ``.block_size``, ``.candidates`` and ``.error``
    (the selection error's message, or ``None``); ``.to_json()`` is ``--json``'s output."""
    return selector.report_attention_backends(platform, config, requested, backends=_backends(backends))
