"""Tool-call parsers (hermes, llama3_json) and the streaming of tool calls: content before
a call goes out as it comes, a call's text is held back and sent as tool-call deltas."""

from __future__ import annotations

import json

import pytest

from kvloom.entrypoints.openai.protocol import ChatCompletionRequest
from kvloom.entrypoints.openai.tool_calls import ToolStream, parse_calls, tool_grammar, tool_mode
from kvloom.tool_parsers.base import ParsedToolCall
from kvloom.tool_parsers.registry import get_tool_parser_cls

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
         {"type": "function", "function": {"name": "g"}}]  # fmt: skip


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_hermes() -> None:
    parser = get_tool_parser_cls("hermes")(None)
    text = 'Let me check.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    found = parser.extract_tool_calls(text)
    assert found.tool_calls == [ParsedToolCall("f", '{"x": 1}'), ParsedToolCall("g", "{}")]
    assert found.content == "Let me check."
    assert parser.extract_tool_calls("<tool_call>{not json</tool_call>").tool_calls == []
    assert parser.extract_tool_calls("plain").content == "plain"


def test_llama3_json() -> None:
    parser = get_tool_parser_cls("llama3_json")(None)
    found = parser.extract_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}')
    assert found.tool_calls == [ParsedToolCall("f", '{"x": 2}'), ParsedToolCall("g", "{}")] and found.content is None
    assert parser.extract_tool_calls("The set {1, 2}").tool_calls == []
    assert parser.find_start("Hi {x}") is None and parser.find_start('  {"name"') == 2


def test_unknown_parser_names_the_ones_there_are() -> None:
    with pytest.raises(ValueError, match=r"unknown parser 'nope' \(available: hermes, llama3_json\)"):
        get_tool_parser_cls("nope")


def test_modes_and_grammars() -> None:
    assert tool_mode(chat(tools=TOOLS, tool_choice="none"), True) is None
    assert tool_mode(chat(tools=TOOLS, tool_choice="required"), False) == "required"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        tool_mode(chat(tools=TOOLS), False)
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})
    assert tool_mode(named, False) == "named"
    assert tool_grammar(named, "named").json == TOOLS[0]["function"]["parameters"]
    required = tool_grammar(chat(tools=TOOLS, tool_choice="required"), "required").json
    assert [item["properties"]["name"]["enum"] for item in required["items"]["anyOf"]] == [["f"], ["g"]]
    with pytest.raises(ValueError, match="no tool is named 'h'"):
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}})
    calls, content = parse_calls('[{"name": "f", "parameters": {"x": 3}}]', "required", chat(tools=TOOLS), None)
    assert calls == [ParsedToolCall("f", '{"x": 3}')] and content is None


def test_streaming_holds_a_call_back_and_sends_it_whole() -> None:
    request = chat(tools=TOOLS)
    stream = ToolStream("auto", get_tool_parser_cls("hermes")(None))
    pieces = ["Sure", ", one", " moment <tool", '_call>{"name": "f", ', '"arguments": {"x": 5}}', "</tool_call>"]
    sent = [stream.feed(p) for p in pieces]
    assert "".join(c for c, _ in sent if c) == "Sure, one moment "
    assert all(calls is None for _, calls in sent)
    rest, calls = stream.finish(request)
    assert rest is None and stream.called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("f", {"x": 5})]
    assert calls[0].id.startswith("chatcmpl-tool-") and calls[0].index == 0


def test_streaming_a_reply_without_a_call_is_all_content() -> None:
    stream = ToolStream("auto", get_tool_parser_cls("hermes")(None))
    sent = "".join(c or "" for c, _ in (stream.feed(p) for p in ["a <tool", "box> b"]))
    rest, calls = stream.finish(chat(tools=TOOLS))
    assert sent + (rest or "") == "a <toolbox> b" and calls is None and not stream.called


def test_streaming_a_named_call_sends_arguments_as_they_come() -> None:
    request = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})
    stream = ToolStream("named", None, "f")
    (_, first), (_, second) = stream.feed('{"x"'), stream.feed(": 7}")
    assert first[0].id and first[0].function.name == "f" and first[0].function.arguments == '{"x"'
    assert second[0].id is None and second[0].function.arguments == ": 7}"
    assert stream.finish(request) == (None, None)
