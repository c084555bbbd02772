"""Chat completions with ``--reasoning-parser``: the reasoning in ``reasoning`` (and
``reasoning_content``), the answer in ``content``, whole and streamed, whatever token
boundaries cut the markers; tool calls found in the answer after the reasoning. A scripted
fake engine plays the model's output piece by piece (the real engine's part, the grammar
after the reasoning, is tests/structured_output/test_reasoning_grammar.py; a real model
through `kvloom serve` is tests/entrypoints/openai/test_new_endpoints_serve.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvloom.entrypoints.openai.api_server import build_app
from kvloom.entrypoints.openai.server_options import FrontendOptions
from tests.entrypoints.openai.test_server import post, sse_events
from tests.helpers.scripted_engine import ScriptedAsyncLLM

TEXT = "<think>I reason.</think>The answer"
CHAT = {"messages": [{"role": "user", "content": "w5"}]}


def app_for(engine: ScriptedAsyncLLM, **frontend: Any) -> TestClient:
    return TestClient(build_app(engine, log_stats=False, frontend=FrontendOptions(**frontend)))


@pytest.fixture(scope="module")
def r1() -> tuple[TestClient, ScriptedAsyncLLM]:
    engine = ScriptedAsyncLLM(reasoning_parser="deepseek_r1")
    return app_for(engine), engine


def streamed(client: TestClient, body: dict) -> tuple[str, str, str, list[dict]]:
    """(reasoning, reasoning_content, content) of a streamed choice 0, and its events."""
    response = post(client, "/v1/chat/completions", {**body, "stream": True})
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    joined = ["".join(d.get(key) or "" for d in deltas) for key in ("reasoning", "reasoning_content", "content")]
    return joined[0], joined[1], joined[2], events


def test_every_cut_of_the_markers(r1: tuple[TestClient, ScriptedAsyncLLM]) -> None:
    client, engine = r1
    cuts = [[TEXT[:i], TEXT[i:]] for i in range(len(TEXT) + 1)] + [list(TEXT)]
    for script in cuts:
        engine.script = script
        assert streamed(client, CHAT)[:3] == ("I reason.", "I reason.", "The answer"), script
        message = post(client, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]
        assert (message["reasoning"], message["reasoning_content"], message["content"]) == (
            "I reason.", "I reason.", "The answer"), script  # fmt: skip


def test_no_answer_yet_and_include_reasoning_false(r1: tuple[TestClient, ScriptedAsyncLLM]) -> None:
    client, engine = r1
    engine.script = ["Still ", "thinking"]
    message = post(client, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "reasoning": "Still thinking",
                       "reasoning_content": "Still thinking"}  # fmt: skip
    engine.script = ["why", "</think>", "ok"]
    message = post(client, "/v1/chat/completions", {**CHAT, "include_reasoning": False}).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "ok"}
    reasoning, _, content, _ = streamed(client, {**CHAT, "include_reasoning": False})
    assert (reasoning, content) == ("", "ok")


def test_without_a_parser_the_markers_stay_in_the_content() -> None:
    client = app_for(ScriptedAsyncLLM([TEXT]))
    message = post(client, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": TEXT}


def test_qwen3_answers_without_reasoning_unless_it_opens_it() -> None:
    engine = ScriptedAsyncLLM(["Just ", "an answer"], reasoning_parser="qwen3")
    client = app_for(engine)
    assert post(client, "/v1/chat/completions", CHAT).json()["choices"][0]["message"] == {
        "role": "assistant", "content": "Just an answer"}  # fmt: skip
    engine.script = ["<th", "ink>", "hm", "</thi", "nk>", "yes"]
    assert streamed(client, CHAT)[:3] == ("hm", "hm", "yes")


def test_tool_calls_are_found_in_the_answer() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine = ScriptedAsyncLLM(["<think>I should call", " get_weather</th", "ink>", call[:9], call[9:]],
                              reasoning_parser="deepseek_r1")  # fmt: skip
    client = app_for(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {**CHAT, "tools": tools}
    choice = post(client, "/v1/chat/completions", body).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning"] == "I should call get_weather" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]  # fmt: skip
    assert choice["finish_reason"] == "tool_calls"
    reasoning, _, content, events = streamed(client, body)
    assert (reasoning, content) == ("I should call get_weather", "")
    calls = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
