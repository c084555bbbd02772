"""POST /v1/responses and GET /v1/responses/{id} over a scripted fake engine, driven by the
official openai client (its ``responses.create``, plain and streaming, and its ``stream``
helper that checks the events add up): text, instructions, input items, function tools
(auto with a tool parser, required), reasoning items and summaries, previous_response_id
from a bounded store, errors in the API's field names. (A real `kvloom serve`:
test_new_endpoints_serve.py.)"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from kvloom.entrypoints.openai import serving_responses
from kvloom.entrypoints.openai.api_server import build_app
from kvloom.entrypoints.openai.server_options import FrontendOptions
from tests.helpers.scripted_engine import ScriptedAsyncLLM

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def engine() -> ScriptedAsyncLLM:
    return ScriptedAsyncLLM(["<think>Let me ", "see</think>", "Hello", " there"], reasoning_parser="deepseek_r1")


@pytest.fixture
def client(engine: ScriptedAsyncLLM) -> openai.OpenAI:
    app = build_app(engine, api_key="k", log_stats=False,
                    frontend=FrontendOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))  # fmt: skip
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=TestClient(app), max_retries=0)


def test_text_reasoning_and_instructions(client: openai.OpenAI, engine: ScriptedAsyncLLM) -> None:
    response = client.responses.create(model="fake-model", input="w5 w6", instructions="Be brief.",
                                       reasoning={"summary": "auto"}, max_output_tokens=10)  # fmt: skip
    assert response.status == "completed" and response.output_text == "Hello there"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me see"
    assert reasoning.summary[0].text == "Let me see"
    assert message.type == "message" and message.role == "assistant"
    assert response.usage.output_tokens == 4 and response.usage.input_tokens > 0
    assert engine.tokenizer.last_messages == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "w5 w6"}]  # fmt: skip
    assert client.responses.retrieve(response.id).output_text == "Hello there"


def test_stream_events_add_up(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="fake-model", input="w5", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me see"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    assert events[-1].response.output_text == "Hello there" and events[-1].response.usage.output_tokens == 4
    with client.responses.stream(model="fake-model", input="w5") as stream:  # the client's own checks
        assert stream.get_final_response().output_text == "Hello there"


def test_input_items_and_previous_response(client: openai.OpenAI, engine: ScriptedAsyncLLM) -> None:
    first = client.responses.create(model="fake-model", input="w5")
    client.responses.create(model="fake-model", previous_response_id=first.id, input=[
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": [{"type": "input_text", "text": "w7"}]},
    ])  # fmt: skip
    assert engine.tokenizer.last_messages == [
        {"role": "user", "content": "w5"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "w7"},
    ]  # fmt: skip


def test_function_tools(client: openai.OpenAI, engine: ScriptedAsyncLLM) -> None:
    engine.script = ["<think>call it</think>", CALL[:12], CALL[12:]]
    response = client.responses.create(model="fake-model", input="weather?", tools=TOOLS)
    reasoning, call = response.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id and engine.tokenizer.last_template_kwargs["tools"][0]["function"]["name"] == "get_weather"
    with client.responses.stream(model="fake-model", input="weather?", tools=TOOLS) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    engine.script = ["</think>", '[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']  # R1: think first
    forced = client.responses.create(model="fake-model", input="weather?", tools=TOOLS, tool_choice="required")
    assert [(c.name, json.loads(c.arguments)) for c in forced.output] == [("get_weather", {"city": "Oslo"})]
    named = {"type": "function", "name": "get_weather"}
    engine.script = ["</think>", '{"city": ', '"Lima"}']
    events = list(client.responses.create(model="fake-model", input="w", tools=TOOLS, tool_choice=named, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"city": "Lima"}]


def test_the_store_is_bounded(client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving_responses, "MAX_STORED_RESPONSES", 2)
    ids = [client.responses.create(model="fake-model", input="w5").id for _ in range(3)]
    unstored = client.responses.create(model="fake-model", input="w5", store=False)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.retrieve(ids[0])
    assert "keeps the latest 2 responses" in error.value.message
    assert client.responses.retrieve(ids[2]).id == ids[2]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model="fake-model", input="w5", previous_response_id=ids[0])
    assert error.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body,param,fragment", [
    ({"input": []}, "input", "must not be an empty list"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "is not supported by kvloom"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "text-only"),
    ({"input": "w5", "tools": [{"type": "web_search"}]}, "tools[0].type", "Input should be 'function'"),
    ({"input": "w5", "max_output_tokens": 100000}, "max_output_tokens", "is too large"),
    ({"input": "w5", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"input": "w5", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "json_schema"),
])  # fmt: skip
def test_errors_name_the_field(client: openai.OpenAI, body: dict[str, Any], param: str, fragment: str) -> None:
    http: TestClient = client._client  # type: ignore[assignment]
    response = http.post("/v1/responses", json=body, headers={"Authorization": "Bearer k"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_the_api_key_is_needed(client: openai.OpenAI) -> None:
    http: TestClient = client._client  # type: ignore[assignment]
    assert http.post("/v1/responses", json={"input": "w5"}).status_code == 401
    assert http.get("/v1/responses/resp_x").status_code == 401


def test_an_output_that_never_ends_its_reasoning(client: openai.OpenAI, engine: ScriptedAsyncLLM) -> None:
    engine.script = ["still ", "thinking"]
    whole = client.responses.create(model="fake-model", input="w5")
    with client.responses.stream(model="fake-model", input="w5") as stream:
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "still thinking" and response.output_text == ""
