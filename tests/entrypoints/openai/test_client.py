"""The server over real HTTP (uvicorn in a thread) with a fake engine: the official
openai client, client disconnects aborting engine requests, periodic stat logging."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from kvloom.entrypoints.openai.api_server import build_app
from kvloom.metrics.stat_logger_base import StatLoggerBase
from tests.helpers.serve_fakes import FakeAsyncLLM, ServerThread, WordTokenizer, expected_text, expected_tokens, make_config
from tests.helpers.waiting import wait_for

TOK = WordTokenizer()


def test_openai_client_completions_and_chat() -> None:
    engine = FakeAsyncLLM()
    with ServerThread(build_app(engine, api_key="k", log_stats=False)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == "fake-model"

        c = client.completions.create(model="fake-model", prompt="w5 w6", max_tokens=4, temperature=0, n=2, logprobs=1)
        assert [ch.text for ch in c.choices] == [expected_text(TOK, expected_tokens([1, 5, 6], 4))] * 2
        assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens == 3
        assert c.choices[0].logprobs.tokens == [TOK.WORDS[t] for t in expected_tokens([1, 5, 6], 4)]

        stream = client.completions.create(model="fake-model", prompt="w5 w6", max_tokens=4, temperature=0,
                                           stream=True, stream_options={"include_usage": True})  # fmt: skip
        chunks = list(stream)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
        assert chunks[-1].usage.completion_tokens == 4

        messages = [{"role": "user", "content": "w5"}]
        chat = client.chat.completions.create(model="fake-model", messages=messages, max_completion_tokens=3,
                                              temperature=0, logprobs=True, top_logprobs=2,
                                              extra_body={"top_k": 5, "ignore_eos": True})  # fmt: skip
        assert chat.choices[0].message.content == expected_text(TOK, expected_tokens([2, 5, 3], 3))
        assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
        assert list(engine.requests.values())[-1]["params"].top_k == 5
        streamed = client.chat.completions.create(model="fake-model", messages=messages, max_completion_tokens=3,
                                                  temperature=0, stream=True)  # fmt: skip
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == chat.choices[0].message.content

        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="other", prompt="w5")
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="fake-model", prompt="w5", temperature=-1)
        assert info.value.body["param"] == "temperature"
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="fake-model", prompt="w5")


def test_streaming_client_disconnect_aborts_engine_requests() -> None:
    engine = FakeAsyncLLM(step_delay=0.02)
    with ServerThread(build_app(engine, log_stats=False)) as server:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            body = {"prompt": "w5", "max_tokens": 60, "ignore_eos": True, "stream": True, "n": 2}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                received = [line for _, line in zip(range(6), lines) if line]
                assert received[0].startswith("data: ")
                assert len(engine.active) == 2
            # The connection is closed mid-stream: the engine request (n=2) is cancelled,
            # both of its sequences aborted.
            assert wait_for(lambda: not engine.active, timeout=5)
            assert len(engine.requests) == 1 and len(engine.core_requests) == 2
            assert sorted(engine.aborted) == sorted(engine.core_requests)
            assert engine.finished == []
            # And the server still serves.
            ok = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
            assert ok.status_code == 200


def test_non_streaming_client_disconnect_aborts_engine_request() -> None:
    engine = FakeAsyncLLM(step_delay=0.02)
    with ServerThread(build_app(engine, log_stats=False)) as server:
        with httpx.Client(base_url=server.url, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}],
                                                        "max_completion_tokens": 60, "ignore_eos": True})  # fmt: skip
        assert wait_for(lambda: len(engine.aborted) == 1, timeout=5)
        assert not engine.active and engine.finished == []


def test_many_concurrent_streams() -> None:
    engine = FakeAsyncLLM(step_delay=0.001)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        prompt = f"w{5 + i % 100}"
        text = ""
        async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                                   "ignore_eos": True, "stream": True}) as r:  # fmt: skip
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run_all(url: str) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    with ServerThread(build_app(engine, log_stats=False)) as server:
        texts = asyncio.run(run_all(server.url))
    for i, text in enumerate(texts):
        assert text == expected_text(TOK, expected_tokens([1, 5 + i % 100], 8))
    assert len(engine.finished) == 64 and not engine.aborted


class _CountingLogger(StatLoggerBase):
    def __init__(self, config, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self.logs = 0

    def record(self, scheduler_stats, iteration_stats, engine_idx: int = 0) -> None:
        pass

    def log(self) -> None:
        self.logs += 1


def test_server_calls_log_every_interval() -> None:
    config = make_config()
    config.observability.log_stats_interval = 0.05
    engine = FakeAsyncLLM(config)
    counting = _CountingLogger(config)
    engine.stat_loggers = [counting]
    with ServerThread(build_app(engine)):
        assert wait_for(lambda: counting.logs >= 3, timeout=5)
