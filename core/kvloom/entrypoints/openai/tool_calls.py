"""Tool calling on /v1/chat/completions: what a request's ``tools`` and ``tool_choice``
ask for, the grammar that enforces ``required`` and named calls, and turning the
generated text into OpenAI ``tool_calls`` (whole, or as streaming deltas).

* ``none`` (or no tools): plain chat; the tools still reach the chat template.
* ``auto`` (the default with tools): the model decides; the server's tool parser
  (``--enable-auto-tool-choice --tool-call-parser NAME``) finds calls in its text.
* ``required``: the output is grammar-constrained to a JSON array of
  ``{"name": <a tool's name>, "parameters": <its arguments schema>}`` (at least one).
* a named function: the output is constrained to that function's arguments schema.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from kvloom.sampling_params import StructuredOutputsParams
from kvloom.tool_parsers.base import ParsedToolCall, ToolParser

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def tool_mode(request: ChatCompletionRequest, auto_enabled: bool) -> str | None:
    """``None`` (no tool calling), ``"auto"``, ``"required"`` or ``"named"``; a
    ``ValueError`` naming the field when the server cannot do what is asked."""
    if not request.tools or request.tool_choice == "none":
        return None
    if isinstance(request.tool_choice, NamedToolChoice):
        return "named"
    if request.tool_choice == "required":
        return "required"
    if not auto_enabled:
        raise ValueError('tool_choice: "auto" tool choice (the default when tools are given) needs the server to '
                         'run with --enable-auto-tool-choice and --tool-call-parser; send tool_choice "required", '
                         'a named function or "none"')  # fmt: skip
    return "auto"


def tool_grammar(request: ChatCompletionRequest, mode: str) -> StructuredOutputsParams:
    """The JSON-schema constraint of a ``required`` or named tool choice."""
    tools = request.tools or []
    if mode == "named":
        assert isinstance(request.tool_choice, NamedToolChoice)
        name = request.tool_choice.function.name
        function = next(t.function for t in tools if t.function.name == name)
        schema: dict[str, Any] = function.parameters or _EMPTY_PARAMETERS
    else:
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [t.function.name]},
                            "parameters": t.function.parameters or _EMPTY_PARAMETERS,
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for t in tools
                ]
            },
        }
    # No free whitespace: the text is parsed, not shown, and stays short.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def parse_calls(text: str, mode: str, request: ChatCompletionRequest, parser: ToolParser | None
                ) -> tuple[list[ParsedToolCall], str | None]:  # fmt: skip
    """The calls in a finished choice's ``text`` and the content left (``text`` itself
    and no calls when it holds none: a reply cut by max_tokens, a model that chose not to
    call)."""
    if mode == "named":
        assert isinstance(request.tool_choice, NamedToolChoice)
        try:
            json.loads(text)
        except ValueError:
            return [], text
        return [ParsedToolCall(request.tool_choice.function.name, text)], None
    if mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return [], text
        return [ParsedToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items], None
    assert parser is not None
    found = parser.extract_tool_calls(text)
    return found.tool_calls, found.content


def as_tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def as_deltas(calls: list[ParsedToolCall], first_index: int = 0) -> list[DeltaToolCall]:
    """Each call whole in one delta (id, type, name and arguments), as OpenAI's first
    delta of a call carries them."""
    return [
        DeltaToolCall(index=first_index + i, id=tool_call_id(), type="function",
                      function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
        for i, c in enumerate(calls)
    ]  # fmt: skip


@dataclass
class ToolStream:
    """One streamed choice's tool-call state: what of its text went out as content, and
    whether a call has started (the rest is held back until the choice ends)."""

    mode: str
    parser: ToolParser | None
    name: str | None = None  # named mode: the function
    text: str = ""
    content_sent: int = 0
    call_started: bool = False
    named_sent: bool = False
    called: bool = False  # whether calls went out (the choice finishes with "tool_calls")

    def feed(self, delta: str) -> tuple[str | None, list[DeltaToolCall] | None]:
        """The content and tool-call deltas to send for ``delta`` of generated text."""
        self.text += delta
        if self.mode == "named":
            if not delta:
                return None, None
            if not self.named_sent:
                self.named_sent = True
                return None, [DeltaToolCall(index=0, id=tool_call_id(), type="function",
                                            function=DeltaFunctionCall(name=self.name, arguments=delta))]  # fmt: skip
            return None, [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
        if self.mode == "required" or self.call_started:
            return None, None
        assert self.parser is not None
        start = self.parser.find_start(self.text)
        if start is not None:
            self.call_started = True
            upto = start
        else:
            upto = self.parser.safe_prefix_len(self.text)
        content = self.text[self.content_sent : upto] if upto > self.content_sent else None
        self.content_sent = max(self.content_sent, upto)
        return content, None

    def finish(self, request: ChatCompletionRequest) -> tuple[str | None, list[DeltaToolCall] | None]:
        """What is left to send when the choice ends."""
        if self.mode == "named":
            return None, None
        if self.mode == "required" or self.call_started:
            calls, content = parse_calls(self.text, self.mode, request, self.parser)
            if calls:
                self.called = True
                rest = None
                if self.mode == "auto" and content and len(content) > self.content_sent:
                    rest = content[self.content_sent :]
                return rest, as_deltas(calls)
        rest = self.text[self.content_sent :]
        self.content_sent = len(self.text)
        return rest or None, None
