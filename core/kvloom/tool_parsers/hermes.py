"""Hermes-style tool calls (Qwen 2.5/3, Hermes 2/3, SmolLM3, ...): each call is a JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``."""

from __future__ import annotations

import json
import re
from typing import ClassVar

from kvloom.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, ToolParser

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name: ClassVar[str] = "hermes"
    start_markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find("<tool_call>")
        if start < 0:
            return ExtractedToolCalls(content=text)
        calls = []
        for body in _CALL.findall(text[start:]):
            try:
                call = json.loads(body)
            except json.JSONDecodeError:
                return ExtractedToolCalls(content=text)  # malformed: the text is the answer
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return ExtractedToolCalls(content=text)
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(ParsedToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
        content = text[:start].strip()
        return ExtractedToolCalls(calls, content or None)
