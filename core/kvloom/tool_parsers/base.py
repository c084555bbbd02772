"""The contract of a tool-call parser: it finds the tool calls in a model's output text
(``--tool-call-parser NAME`` with ``--enable-auto-tool-choice``). Built in: ``hermes`` and
``llama3_json``; more come as plugins of the ``kvloom.tool_parsers`` entry-point group."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON string."""

    name: str
    """The function's name."""
    arguments: str
    """Its arguments, a JSON string."""


@dataclass
class ExtractedToolCalls:
    """What a parser found: the calls, and the text that is not part of them (``None``
    when there is none)."""

    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    """The calls, in order."""
    content: str | None = None
    """The text outside the calls (``None``: none)."""

    @property
    def tools_called(self) -> bool:
        """Whether any call was found."""
        return bool(self.tool_calls)


class ToolParser(abc.ABC):
    """Finds tool calls in generated text. ``name`` is what ``--tool-call-parser`` selects
    (and a plugin's entry-point name).

    Streaming: the server sends the text before ``start_markers`` as content as it
    comes; from the first marker on, it holds the text back and, when the output ends,
    sends the calls ``extract_tool_calls`` finds (each as a tool-call delta with its id,
    name and arguments), so a parser implements the one method."""

    name: ClassVar[str]
    """What ``--tool-call-parser`` selects (a plugin's entry-point name)."""
    start_markers: ClassVar[tuple[str, ...]]
    """Strings that start a tool call in this format."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The tool calls in the complete output ``text``; none (and ``content=text``)
        when it holds no well-formed call."""

    def find_start(self, text: str) -> int | None:
        """Where the first tool call starts in ``text`` (None: nowhere yet)."""
        positions = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(positions) if positions else None

    def safe_prefix_len(self, text: str) -> int:
        """How much of ``text`` (with no complete marker) can be sent as content: all but
        a tail that could be the beginning of a marker."""
        keep = 0
        for marker in self.start_markers:
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    keep = max(keep, n)
                    break
        return len(text) - keep
