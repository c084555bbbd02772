"""Tool-call parsers by name: the built-in ``hermes`` and ``llama3_json``, and plugins of
the ``kvloom.tool_parsers`` entry-point group (``docs/structured_outputs.md``)."""

from __future__ import annotations

from kvloom.tool_parsers.base import ToolParser
from kvloom.tool_parsers.hermes import HermesToolParser
from kvloom.tool_parsers.llama3_json import Llama3JsonToolParser

BUILT_IN: dict[str, type[ToolParser]] = {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser)}


def available_tool_parsers() -> dict[str, type[ToolParser]]:
    """Parser name -> class: the built-in ones and the loaded plugins."""
    from kvloom import plugins

    return plugins.tool_parsers(BUILT_IN)


def get_tool_parser_cls(name: str) -> type[ToolParser]:
    from kvloom import plugins

    return plugins.pick_by_name(available_tool_parsers(), name, "--tool-call-parser", "parser")

