"""Reasoning parsers by name: the built-in ``deepseek_r1`` and ``qwen3``, and plugins of the
``kvloom.reasoning_parsers`` entry-point group."""

from __future__ import annotations

from typing import Any

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
    from kvloom import plugins

    return plugins.pick_by_name(available_reasoning_parsers(), name, "--reasoning-parser", "parser")


def reasoning_parser_for(config: Any, tokenizer: Any) -> ReasoningParser | None:
    """The server's reasoning parser (``--reasoning-parser``), None without one; a
    ``ValueError`` naming the flag when it cannot work with this model."""
    structured = getattr(config, "structured_outputs", None)
    name = getattr(structured, "reasoning_parser", None)
    if name is None:
        return None
    if tokenizer is None:
        raise ValueError(f"--reasoning-parser {name}: needs the model's tokenizer (drop --skip-tokenizer-init)")
    return get_reasoning_parser_cls(name)(tokenizer)
