"""Reasoning parsers by name: the built-in ``deepseek_r1`` and ``qwen3``, and plugins of the
``kvloom.reasoning_parsers`` entry-point group."""

from __future__ import annotations

from kvloom.reasoning.base import ReasoningParser
from kvloom.reasoning.parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

BUILT_IN: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def available_reasoning_parsers() -> dict[str, type[ReasoningParser]]:
    """Parser name -> class: the built-in ones and the loaded plugins."""
    from kvloom import plugins

    return plugins.reasoning_parsers(BUILT_IN)


def get_reasoning_parser_cls(name: str) -> type[ReasoningParser]:
    parsers = available_reasoning_parsers()
    if name not in parsers:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} (available: {', '.join(sorted(parsers))})")
    return parsers[name]
