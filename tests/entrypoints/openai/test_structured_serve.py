"""Structured outputs and tool calling against a real ``kvloom serve`` of the default
model (SmolLM2 GGUF, CPU), with the official openai client unchanged:
``chat.completions.parse(response_format=PydanticModel)``, tool_choice "required" and a
named function, streaming and not; a bad schema is a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from kvloom.loader.model_source import default_model_path
from kvloom.testing.install import KvloomServer

pytestmark = pytest.mark.slow

MODEL = "smol"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    name: str = Field(max_length=12)
    species: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    args = [str(default_model_path()), "--served-model-name", MODEL, "--max-model-len", "1024",
            "--kv-cache-memory", "64MiB", "--disable-log-stats", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes"]  # fmt: skip
    with KvloomServer(args, tmp_path_factory.mktemp("serve")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    completion = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Pet,
                                               max_completion_tokens=150, temperature=0)  # fmt: skip
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet), completion.choices[0].message.content
    with client.chat.completions.stream(model=MODEL, messages=messages, response_format=Pet,
                                        max_completion_tokens=150, temperature=0) as stream:  # fmt: skip
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == pet  # greedy: the same object


def _streamed_calls(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    for tool_choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                      max_completion_tokens=200, temperature=0)  # fmt: skip
        result = client.chat.completions.create(**kwargs)
        message = result.choices[0].message
        assert message.tool_calls, message.content
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            assert call.function.name in ("get_weather", "get_time") and (name is None or call.function.name == name)
            arguments = json.loads(call.function.arguments)
            assert set(arguments) == ({"city", "unit"} if call.function.name == "get_weather" else {"zone"})
        assert result.choices[0].finish_reason == ("stop" if name else "tool_calls")
        calls, finish = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        assert all(c["id"] for c in calls) and finish == result.choices[0].finish_reason


def test_a_conversation_with_tool_results(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}  # fmt: skip
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]  # fmt: skip
    result = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto",
                                            max_completion_tokens=20, temperature=0)  # fmt: skip
    choice = result.choices[0]
    assert choice.message.content or choice.message.tool_calls


def test_regex_choice_and_bad_schemas(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="A year:", max_tokens=8, temperature=1.0,
                                     extra_body={"guided_regex": "(19|20)[0-9]{2}"}).choices[0].text  # fmt: skip
    assert len(text) == 4 and text[:2] in ("19", "20") and text.isdigit()
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=5, temperature=1.0,
                                          extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})  # fmt: skip
    assert chat.choices[0].message.content in ("sunny", "rainy")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad)  # type: ignore[arg-type]
    assert info.value.body["param"] == "response_format" and 'Unsupported type "strng"' in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "a(b"})
    assert info.value.body["param"] == "guided_regex" and "parenthesis" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       response_format={"type": "json_object"})  # fmt: skip
    assert info.value.body["param"] == "tool_choice"
