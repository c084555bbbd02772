"""Llama 3.x JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``."""

from __future__ import annotations

import json
from typing import ClassVar

from kvloom.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, ToolParser

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name: ClassVar[str] = "llama3_json"
    start_markers: ClassVar[tuple[str, ...]] = (_PYTHON_TAG, "{")

    def find_start(self, text: str) -> int | None:
        """A call only where the reply starts (after whitespace) with the tag or ``{``:
        a brace later in prose is prose."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_markers):
            return len(text) - len(stripped)
        return None

    def safe_prefix_len(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or _PYTHON_TAG.startswith(stripped):
            return 0  # may still become a call
        return len(text)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return ExtractedToolCalls(content=text)
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                call, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ExtractedToolCalls(content=text)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return ExtractedToolCalls(content=text)
            arguments = call.get("parameters", call.get("arguments", {}))
            calls.append(ParsedToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        return ExtractedToolCalls(calls, None)
