"""The server accepts what clients send (issue 18, item 2), as vLLM does: unknown fields
with a warning, ``null`` for any optional field as its default, ``best_of`` equal to n;
a field of a feature kvloom has not built is a 400 naming it. (The fake engine; the
official ``openai`` client against a real ``kvloom serve`` is in ``test_client.py``.)"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvloom.entrypoints.openai.api_server import build_app
from kvloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.entrypoints.openai.test_server import assert_error, post
from tests.helpers.serve_fakes import FakeAsyncLLM

CHAT_MESSAGES = [{"role": "user", "content": "w5"}]


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture
def client(engine: FakeAsyncLLM) -> TestClient:
    return TestClient(build_app(engine, log_stats=False), raise_server_exceptions=False)


def _last_params(engine: FakeAsyncLLM) -> Any:
    return list(engine.requests.values())[-1]["params"]


def _nulls(model: type) -> dict[str, None]:
    """Every optional field of ``model`` as null."""
    return {name: None for name, field in model.model_fields.items() if not field.is_required()}


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "w5", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": CHAT_MESSAGES, "max_tokens": 2}),
])  # fmt: skip
def test_unknown_fields_are_accepted_with_a_warning(client: TestClient, caplog: pytest.LogCaptureFixture,
                                                   path: str, body: dict) -> None:  # fmt: skip
    extra = {"store": False, "metadata": {"k": "v"}, "parallel_tool_calls": True, "service_tier": "auto",
             "reasoning_effort": "low", "stream_options": None, "x" * 500: 1}
    with caplog.at_level(logging.WARNING, logger="kvloom.entrypoints.openai.errors"):
        r = post(client, path, {**body, **extra})
    assert r.status_code == 200, r.text
    warning = " ".join(rec.getMessage() for rec in caplog.records)
    assert "present in the request but ignored" in warning
    for name in ("store", "metadata", "parallel_tool_calls"):
        assert repr(name) in warning
    assert "x" * 65 not in warning  # long names are cut


def test_every_optional_completion_field_may_be_null(client: TestClient, engine: FakeAsyncLLM) -> None:
    body = {**_nulls(CompletionRequest), "prompt": "w5"}
    r = post(client, "/v1/completions", body)
    assert r.status_code == 200, r.text
    params = _last_params(engine)
    assert params.n == 1 and params.logprobs is None
    assert r.json()["choices"][0]["logprobs"] is None


def test_every_optional_chat_field_may_be_null(client: TestClient, engine: FakeAsyncLLM) -> None:
    body = {**_nulls(ChatCompletionRequest), "messages": CHAT_MESSAGES, "max_completion_tokens": 2}
    r = post(client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert _last_params(engine).max_tokens == 2


def test_nulls_of_the_reported_fields_mean_the_defaults(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/completions", {"prompt": "w5", "max_tokens": 2, "logprobs": None, "stream": None, "n": None,
                                         "echo": None, "best_of": None, "temperature": None, "top_p": None})  # fmt: skip
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["object"] == "text_completion"
    r = post(client, "/v1/chat/completions", {"messages": CHAT_MESSAGES, "max_tokens": 2, "logprobs": None,
                                              "stream": None, "n": None, "top_logprobs": None})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


def test_best_of_equal_to_n_is_accepted_and_else_explained(client: TestClient) -> None:
    assert post(client, "/v1/completions", {"prompt": "w5", "max_tokens": 1, "n": 2, "best_of": 2}).status_code == 200
    assert_error(post(client, "/v1/completions", {"prompt": "w5", "best_of": 3}), 400,
                 "best_of: only best_of == n (or null) is supported", "vLLM V1", param="best_of")  # fmt: skip


@pytest.mark.parametrize("field,value,fragment", [
    ("functions", [{"name": "f"}], "function calling"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio output"),
    ("modalities", ["text", "audio"], "output modalities"),
    ("chat_template", "{{ messages }}", "--chat-template"),
])  # fmt: skip
def test_features_not_built_are_a_400_naming_the_field(client: TestClient, field: str, value: Any,
                                                       fragment: str) -> None:  # fmt: skip
    r = post(client, "/v1/chat/completions", {"messages": CHAT_MESSAGES, field: value})
    assert_error(r, 400, f"{field}: ", fragment, "not supported by kvloom yet", param=field)


@pytest.mark.parametrize("field,value", [("tool_choice", "none"), ("tool_choice", "auto"), ("tools", []),
                                         ("response_format", {"type": "text"}), ("modalities", ["text"])])
def test_harmless_values_of_those_fields_are_accepted(client: TestClient, field: str, value: Any) -> None:
    body = {"messages": CHAT_MESSAGES, "max_tokens": 1, field: value}
    assert post(client, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])  # fmt: skip
def test_image_and_audio_parts_are_a_400_naming_them(client: TestClient, part: dict) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "w5"}, part]}]}
    assert_error(post(client, "/v1/chat/completions", body), 400, "messages[0].content",
                 f"content parts of type '{part['type']}' are not supported by kvloom yet", param="messages[0].content")


def test_completion_features_not_built(client: TestClient) -> None:
    assert_error(post(client, "/v1/completions", {"prompt": "w5", "suffix": "w6"}), 400,
                 "suffix", "not supported by kvloom yet", param="suffix")  # fmt: skip
    assert_error(post(client, "/v1/completions", {"prompt": "w5", "response_format": {"type": "xml"}}),
                 400, "response_format: type must be", param="response_format")  # fmt: skip


def test_chat_template_kwargs_reach_the_template(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/chat/completions", {"messages": CHAT_MESSAGES, "max_tokens": 1,
                                              "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert r.status_code == 200, r.text
    assert engine.tokenizer.last_template_kwargs == {"enable_thinking": False}
    assert_error(post(client, "/v1/chat/completions", {"messages": CHAT_MESSAGES,
                                                       "chat_template_kwargs": {"tokenize": True}}),
                 400, "chat_template_kwargs: tokenize cannot be set", param="chat_template_kwargs")  # fmt: skip
