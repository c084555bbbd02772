"""The structured-output options of ``EngineArgs``: the flat flags
(``--structured-outputs-backend``, ``--reasoning-parser``) and vLLM's
``--structured-outputs-config`` JSON object, checked and merged into the engine's
``StructuredOutputsConfig``. Imports nothing heavy (``EngineArgs`` is read by ``kvloom --help``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.config import StructuredOutputsConfig

#: The keys of ``--structured-outputs-config`` kvloom takes, with their types.
CONFIG_KEYS: dict[str, type] = {"backend": str, "reasoning_parser": str, "enable_in_reasoning": bool}
DEFAULT_BACKEND = "xgrammar"


def check_structured_outputs_config(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``value`` if its keys and types are ones kvloom takes, else a ``ValueError`` naming them."""
    if value is None:
        return None
    unknown = sorted(set(value) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(CONFIG_KEYS)})")
    for key, kind in CONFIG_KEYS.items():
        if key in value and not (isinstance(value[key], kind) or (kind is str and value[key] is None)):
            raise ValueError(f"{key} must be a {kind.__name__} (got {value[key]!r:.40})")
    return value


def structured_outputs_options(backend: str, reasoning_parser: str | None, config: dict[str, Any] | None
                               ) -> tuple[str, str | None, bool]:  # fmt: skip
    """(backend, reasoning parser, enable_in_reasoning): the flat flags, or what ``config``
    says (a ``ValueError`` when the two disagree)."""
    options = config or {}
    chosen_backend = options.get("backend") or backend
    chosen_parser = options.get("reasoning_parser") or reasoning_parser
    if backend not in (DEFAULT_BACKEND, chosen_backend):  # a flag other than its default
        raise ValueError(f"structured_outputs_config: backend {chosen_backend!r} disagrees with "
                         f"--structured-outputs-backend {backend!r}; give one of them")  # fmt: skip
    if reasoning_parser not in (None, chosen_parser):
        raise ValueError(f"structured_outputs_config: reasoning_parser {chosen_parser!r} disagrees with "
                         f"--reasoning-parser {reasoning_parser!r}; give one of them")  # fmt: skip
    return chosen_backend, chosen_parser, bool(options.get("enable_in_reasoning", False))


def structured_outputs_config(backend: str, reasoning_parser: str | None, enable_in_reasoning: bool
                              ) -> "StructuredOutputsConfig":  # fmt: skip
    """The engine's section (an unknown reasoning parser is a ``ValueError`` naming the known ones)."""
    from kvloom.config import StructuredOutputsConfig
    from kvloom.reasoning.registry import get_reasoning_parser_cls

    if reasoning_parser is not None:
        get_reasoning_parser_cls(reasoning_parser)
    return StructuredOutputsConfig(backend=backend, reasoning_parser=reasoning_parser,
                                   enable_in_reasoning=enable_in_reasoning)  # fmt: skip
