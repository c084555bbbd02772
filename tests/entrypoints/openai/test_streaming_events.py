"""Streams send one token per event while the client keeps up, and coalesce only under
back-pressure: ``AsyncLLM`` on a scripted engine core that makes two steps ready at once
(the engine ahead of the front end), read by keeping-up consumers, by a slow one, with the
front end itself behind the engine, and through the server's SSE stream."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvloom.engine.async_llm import AsyncLLM
from kvloom.entrypoints.openai.api_server import build_app
from kvloom.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers.model_fixtures import make_test_engine_config, tiny_model_dir
from tests.helpers.scripted_core import ScriptedEngineCore, word_token_ids
from tests.helpers.serve_fakes import ServerThread


@pytest.fixture(scope="module")
def config():
    return make_test_engine_config(tiny_model_dir("llama"))


def word_tokens(config) -> list[int]:
    return word_token_ids(config.model.tokenizer, 5)


def engine_on(config, monkeypatch, core: ScriptedEngineCore) -> AsyncLLM:
    ScriptedEngineCore.install(monkeypatch, core)
    return AsyncLLM(config, log_stats=False)


DELTA = RequestOutputKind.DELTA


def test_keeping_up_consumers_get_one_token_per_output_and_a_slow_one_all_tokens(config, monkeypatch) -> None:
    tokens = word_tokens(config)
    core = ScriptedEngineCore(tokens, steps_per_read=2, step_delay=0.001)
    engine = engine_on(config, monkeypatch, core)
    params = SamplingParams(max_tokens=12, output_kind=DELTA, ignore_eos=True)

    async def consume(i: int, pause: float) -> list[list[int]]:
        deltas = []
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, request_id=f"r{i}"):
            deltas.append(list(out.outputs[0].token_ids))
            if pause:
                await asyncio.sleep(pause)  # a client that falls behind
        return deltas

    async def run() -> list[list[list[int]]]:
        return await asyncio.gather(consume(0, 0), consume(1, 0), consume(2, 0.01))

    try:
        fast_a, fast_b, slow = asyncio.run(run())
    finally:
        engine.shutdown()
    expected = [tokens[k % len(tokens)] for k in range(12)]
    for deltas in (fast_a, fast_b):
        assert deltas == [[t] for t in expected]  # one token per output although two steps came at once
    # The slow reader got everything, coalesced: fewer outputs than tokens, none lost or repeated.
    assert [t for d in slow for t in d] == expected and len(slow) < 12


def test_a_front_end_behind_the_engine_coalesces_until_it_caught_up(config, monkeypatch) -> None:
    from kvloom.engine.async_llm import CATCH_UP_LAG_S

    tokens = word_tokens(config)
    engine = engine_on(config, monkeypatch, ScriptedEngineCore(tokens, steps_per_read=2, lag=2 * CATCH_UP_LAG_S))
    params = SamplingParams(max_tokens=12, output_kind=DELTA, ignore_eos=True)

    async def consume() -> list[list[int]]:
        return [list(out.outputs[0].token_ids)
                async for out in engine.generate({"prompt_token_ids": [5, 6]}, params, request_id="behind")]  # fmt: skip

    try:
        deltas = asyncio.run(consume())
    finally:
        engine.shutdown()
    assert [t for d in deltas for t in d] == [tokens[k % len(tokens)] for k in range(12)]
    assert all(len(d) == 2 for d in deltas)  # each pair of steps ready at once became one output


def test_server_stream_sends_one_token_per_event(config, monkeypatch) -> None:
    tokens = word_tokens(config)
    core = ScriptedEngineCore(tokens, steps_per_read=2, step_delay=0.002)
    engine = engine_on(config, monkeypatch, core)
    with ServerThread(build_app(engine, log_stats=False)) as server:
        body = {"prompt": [5, 6, 7], "max_tokens": 10, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
    # Each token is one word with its leading space: the words of an event are its tokens.
    per_event = [len(e["choices"][0]["text"].split()) for e in events if e["choices"]]
    assert per_event == [1] * 10
