"""POST /v1/messages and /v1/messages/count_tokens over a scripted fake engine, driven by the
official anthropic client (``messages.create``, plain and streaming, and its ``stream``
helper that assembles the events): system, content blocks, thinking blocks from the
reasoning parser, tools (tool_use out, tool_result in, tool_choice any/tool), stop
sequences, Anthropic's error bodies (the API key's too). (A real `kvloom serve`:
tests/entrypoints/openai/test_new_endpoints_serve.py.)"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from fastapi.testclient import TestClient

from kvloom.entrypoints.openai.api_server import build_app
from kvloom.entrypoints.openai.server_options import FrontendOptions
from tests.helpers.scripted_engine import ScriptedAsyncLLM

TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
USER = [{"role": "user", "content": "w5 w6"}]


@pytest.fixture
def engine() -> ScriptedAsyncLLM:
    return ScriptedAsyncLLM(["<think>Let me ", "see</think>", "Hello", " there"], reasoning_parser="deepseek_r1")


@pytest.fixture
def http(engine: ScriptedAsyncLLM) -> TestClient:
    return TestClient(build_app(engine, api_key="k", log_stats=False,
                                frontend=FrontendOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")))


@pytest.fixture
def client(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=http, max_retries=0)


def test_text_thinking_and_system(client: anthropic.Anthropic, engine: ScriptedAsyncLLM) -> None:
    message = client.messages.create(model="fake-model", max_tokens=20, system="Be brief.", messages=USER)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me see"
    assert text.type == "text" and text.text == "Hello there"
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 4 and message.usage.input_tokens > 0
    assert engine.tokenizer.last_messages == [{"role": "system", "content": "Be brief."}, *USER]
    assert client.messages.count_tokens(model="fake-model", messages=USER, system="Be brief.").input_tokens == (
        message.usage.input_tokens)  # fmt: skip


def test_stream(client: anthropic.Anthropic) -> None:
    events = list(client.messages.create(model="fake-model", max_tokens=20, messages=USER, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    with client.messages.stream(model="fake-model", max_tokens=20, messages=USER) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Hello there"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 4


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic, engine: ScriptedAsyncLLM) -> None:
    engine.script = ["</think>", "one", " two", " three"]
    message = client.messages.create(model="fake-model", max_tokens=20, messages=USER, stop_sequences=["two"])
    assert (message.content[-1].text, message.stop_reason, message.stop_sequence) == ("one ", "stop_sequence", "two")
    message = client.messages.create(model="fake-model", max_tokens=2, messages=USER)
    assert message.stop_reason == "max_tokens"


def test_tools(client: anthropic.Anthropic, engine: ScriptedAsyncLLM) -> None:
    engine.script = ["<think>call it</think>", CALL[:12], CALL[12:]]
    message = client.messages.create(model="fake-model", max_tokens=50, messages=USER, tools=TOOLS)
    call = message.content[-1]
    assert (call.type, call.name, call.input, message.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"},
                                                                       "tool_use")  # fmt: skip
    with client.messages.stream(model="fake-model", max_tokens=50, messages=USER, tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert final.content[-1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    engine.script = ["</think>", '{"city": ', '"Lima"}']
    forced = client.messages.create(model="fake-model", max_tokens=50, messages=USER, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert [(b.type, b.input) for b in forced.content] == [("tool_use", {"city": "Lima"})]
    client.messages.create(model="fake-model", max_tokens=50, tools=TOOLS, messages=[
        *USER,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "w7"}]},
    ])  # fmt: skip
    assert engine.tokenizer.last_messages[1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "w7"},
    ]  # fmt: skip


@pytest.mark.parametrize("body,status,kind,fragment", [
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens: Input should be greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0]: a 'image' block is not supported"),
    ({"model": "claude-x"}, 404, "not_found_error", "claude-x"),
    ({"max_tokens": 100000}, 400, "invalid_request_error", "max_tokens: 100000 is too large"),
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, 400, "invalid_request_error", "tool_choice.name: needed"),
])  # fmt: skip
def test_errors_are_anthropics(http: TestClient, body: dict[str, Any], status: int, kind: str, fragment: str) -> None:
    full = {"model": "fake-model", "max_tokens": 10, "messages": USER, **body}
    response = http.post("/v1/messages", json=full, headers={"x-api-key": "k"})
    assert response.status_code == status, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind
    assert fragment in response.json()["error"]["message"], response.json()


def test_the_api_key(http: TestClient, client: anthropic.Anthropic) -> None:
    response = http.post("/v1/messages", json={"model": "fake-model", "max_tokens": 5, "messages": USER})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url="http://testserver", auth_token="k", http_client=http, max_retries=0)
    assert bearer.messages.create(model="fake-model", max_tokens=5, messages=USER).content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url="http://testserver", api_key="no", http_client=http, max_retries=0).messages.create(
            model="fake-model", max_tokens=5, messages=USER)  # fmt: skip


def test_unknown_methods_and_big_bodies_answer_in_anthropics_shape(http: TestClient) -> None:
    wrong = http.get("/v1/messages", headers={"x-api-key": "k"})
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"
    form = http.post("/v1/messages", content="a=1", headers={"x-api-key": "k", "Content-Type": "text/plain"})
    assert form.status_code == 415 and form.json()["error"]["type"] == "invalid_request_error"
