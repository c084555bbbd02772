"""``ChunkTemplate``: a streamed text chunk filled into pydantic's own JSON of the chunk model
is the JSON pydantic writes for that text (any text: quotes, escapes, non-ASCII, control
characters), and a template without exactly one placeholder is refused."""

from __future__ import annotations

import json

import pytest

from kvloom.entrypoints.openai.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from kvloom.entrypoints.openai.serving_chat import OpenAIServingChat
from kvloom.entrypoints.openai.serving_engine import ChunkTemplate, sse

TEXTS = ["tok", " a \"quoted\" word", "back\\slash", "new\nline\ttab", "żółw 🐢 漢字", "\x00\x1f\x7f", "", "</script>"]


def completion(text: str) -> CompletionStreamResponse:
    return CompletionStreamResponse(id="cmpl-7", created=1700000000, model="org/m \"x\"",
                                    choices=[CompletionResponseChoice(index=3, text=text)])  # fmt: skip


def chat(text: str) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id="chatcmpl-7", created=1700000000, model="m",
                                        choices=[ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(
                                            content=text))])  # fmt: skip


def completion_json(text: str) -> str:
    return completion(text).model_dump_json()


def chat_json(text: str) -> str:
    return OpenAIServingChat.chunk_json(chat(text))  # OpenAI's form: the delta carries only what it sets


@pytest.mark.parametrize("make", [completion_json, chat_json])
@pytest.mark.parametrize("text", TEXTS)
def test_filled_template_is_the_streams_json(make, text: str) -> None:
    filled = ChunkTemplate(make(ChunkTemplate.TEXT)).sse(text)
    expected = sse(make(text))
    assert filled.startswith("data: ") and filled.endswith("\n\n")
    assert json.loads(filled[6:]) == json.loads(expected[6:])
    if text.isascii() and text.isprintable():
        assert filled == expected  # byte for byte where both write the text the same way
    assert '"delta": {"content": ' in filled or make is completion_json


def test_a_template_needs_the_placeholder_exactly_once() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        ChunkTemplate(completion_json("no placeholder"))
    twice = CompletionStreamResponse(id=ChunkTemplate.TEXT, created=1, model="m",
                                     choices=[CompletionResponseChoice(index=0, text=ChunkTemplate.TEXT)])  # fmt: skip
    with pytest.raises(ValueError, match="exactly once"):
        ChunkTemplate(twice.model_dump_json())


def test_only_a_content_only_chat_chunk_takes_the_template() -> None:
    from kvloom.entrypoints.openai.protocol import ChatCompletionLogProbs, UsageInfo
    from kvloom.entrypoints.openai.serving_chat import _content_only

    def one(finish: str | None = None, logprobs: ChatCompletionLogProbs | None = None, **delta: object):
        choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(**delta), finish_reason=finish,
                                                    logprobs=logprobs)  # fmt: skip
        return ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[choice])

    assert _content_only(one(content="hi")) == "hi"
    for chunk in (one(role="assistant", content=""), one(content="hi", finish="stop"), one(content=None),
                  one(content="hi", reasoning="r", reasoning_content="r"), one(content="hi", tool_calls=[]),
                  one(content="hi", logprobs=ChatCompletionLogProbs(content=[])),
                  ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[],
                                               usage=UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2))):  # fmt: skip
        assert _content_only(chunk) is None
