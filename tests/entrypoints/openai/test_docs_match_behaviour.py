"""docs/serving.md and the VLLM_FLAGS notes checked against what the server does (issue 36):
every field the serving guide calls unsupported is sent and must be a 400 naming it, every
feature it says works must answer 200, and ``"max_tokens": null`` does what the guide says.
The field list is read from the guide, so a guide that names a field the test does not
know, or misses one the test sends, fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvloom.engine.arg_utils import EngineArgs
from kvloom.entrypoints.cli.vllm_flags import VLLM_FLAGS
from kvloom.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai.test_server import post
from tests.helpers.serve_fakes import FakeAsyncLLM

SERVING_MD = Path(__file__).resolve().parents[3] / "docs" / "serving.md"
MESSAGES = [{"role": "user", "content": "w5"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

#: Each field (or content part) the guide calls unsupported -> the endpoints and value that ask for it.
UNSUPPORTED: dict[str, tuple[tuple[str, ...], Any]] = {
    "functions": ((CHAT,), [{"name": "f", "parameters": {}}]),
    "function_call": ((CHAT,), {"name": "f"}),
    "audio": ((CHAT,), {"voice": "alloy", "format": "wav"}),
    "modalities": ((CHAT,), ["text", "audio"]),
    "chat_template": ((CHAT,), "{{ messages }}"),
    "echo": ((CHAT,), True),
    "documents": ((CHAT,), [{"title": "t", "text": "d"}]),
    "mm_processor_kwargs": ((CHAT,), {"size": 1}),
    "image_url": ((CHAT,), {"url": "data:image/png;base64,AAAA"}),
    "input_audio": ((CHAT,), {"data": "AAAA", "format": "wav"}),
    "suffix": ((COMPLETIONS,), "w6"),
    "prompt_embeds": ((COMPLETIONS,), "AAAA"),
    "logits_processors": ((CHAT, COMPLETIONS), ["my_module.MyProcessor"]),
    "bad_words": ((CHAT, COMPLETIONS), ["w6"]),
}
#: Backticked words of that paragraph that qualify a field rather than name one.
QUALIFIERS = {"none", "auto", '["text"]', "--chat-template", "text", "vllm_xargs"}

#: What the guide says works although an older guide called it a 400.
WORKS: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["w5", "w6"]},
    "guided_choice": ["w5", "w6"],
}


def _paragraph(start: str, end: str) -> str:
    text = " ".join(SERVING_MD.read_text().split())
    return text[text.index(start):text.index(end)]


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


@pytest.fixture
def served() -> tuple[TestClient, FakeAsyncLLM]:
    engine = FakeAsyncLLM()
    return TestClient(build_app(engine, log_stats=False), raise_server_exceptions=False), engine


def _body(path: str, field: str, value: Any) -> dict[str, Any]:
    if field in ("image_url", "input_audio"):
        part = {"type": field, field: value}
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "w5"}, part]}], "max_tokens": 1}
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "w5"}
    return {**base, "max_tokens": 1, field: value}


def test_the_guide_lists_what_the_test_sends() -> None:
    refused = _paragraph("is a 400 naming it", "Tools (`tools`")
    assert _backticked(refused) - QUALIFIERS == set(UNSUPPORTED)
    works = _paragraph("Tools (`tools`", "Chat takes")
    assert {name.removesuffix("*") for name in _backticked(works)} >= {"tools", "tool_choice", "response_format",
                                                                       "structured_outputs", "guided_"}  # fmt: skip


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_every_field_the_guide_calls_unsupported_is_a_400_naming_it(served: tuple, field: str) -> None:
    client, _ = served
    paths, value = UNSUPPORTED[field]
    for path in paths:
        r = post(client, path, _body(path, field, value))
        assert r.status_code == 400, (path, field, r.text)
        assert field in r.json()["error"]["message"] and "not supported by kvloom" in r.json()["error"]["message"]


@pytest.mark.parametrize("field", sorted(WORKS))
def test_what_the_guide_says_works_answers_200(served: tuple, field: str) -> None:
    client, _ = served
    # tool_choice "required" needs tools, tools need a tool_choice the server can honour
    # without --tool-call-parser: each asks for the other.
    extra = {name: WORKS[name] for name in ("tools", "tool_choice")} if field in ("tools", "tool_choice") else {}
    r = post(client, CHAT, {**_body(CHAT, field, WORKS[field]), **extra})
    assert r.status_code == 200, r.text


def test_max_tokens_null_and_left_out_on_completions(served: tuple) -> None:
    """The guide: 16 when left out; null runs to the end of the context (as vLLM)."""
    client, engine = served
    assert "`max_tokens` (default 16 when left out; `null` means no limit but the context" in " ".join(
        SERVING_MD.read_text().split())
    room = engine.config.model.max_model_len - len(engine.tokenizer.encode("w5"))
    for body, expected in (({}, 16), ({"max_tokens": None}, room)):
        assert post(client, COMPLETIONS, {"prompt": "w5", **body}).status_code == 200
        assert list(engine.requests.values())[-1]["params"].max_tokens == expected


def test_vllm_flag_notes_of_working_flags_claim_nothing_missing() -> None:
    """A flag the table says works must not be noted as unbuilt (the Ray note did)."""
    for flag in VLLM_FLAGS:
        if flag.status == "works":
            assert not re.search(r"not (built|supported)|not yet", flag.note or ""), (flag.name, flag.note)
    assert EngineArgs(distributed_executor_backend="ray").distributed_executor_backend == "ray"

