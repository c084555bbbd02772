"""n > 1 through the server: each prompt is one engine request with ``SamplingParams(n=...)``
and the engine fans it out, so the server's choices are exactly the engine's sequences
(the same seeds as offline ``LLM.generate``), and a client that goes away aborts them all.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from tests.helpers.model_fixtures import random_prompts, tiny_async_llm, tiny_model_dir
from tests.helpers.serve_fakes import FakeAsyncLLM, ServerThread
from tests.helpers.waiting import wait_for

from kvloom import LLM, SamplingParams
from kvloom.engine.async_llm import AsyncLLM
from kvloom.entrypoints.openai.api_server import build_app
from kvloom.entrypoints.openai.serving_engine import merge_async_iterators
from kvloom.outputs import EngineCoreOutputs

PROMPT = random_prompts(320)[2]


def test_merge_async_iterators_interleaves_and_closing_stops_every_iterator() -> None:
    closed: list[int] = []

    async def numbers(i: int, count: int) -> AsyncGenerator[int, None]:
        try:
            for k in range(count):
                await asyncio.sleep(0)
                yield k
        finally:
            closed.append(i)

    async def run() -> None:
        items = [item async for item in merge_async_iterators(numbers(0, 3), numbers(1, 2))]
        assert sorted(items) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
        assert [k for i, k in items if i == 0] == [0, 1, 2]  # each iterator's order is kept
        for count in (1, 3):
            closed.clear()
            iterators = [numbers(i, 100) for i in range(count)]  # held: no help from the GC
            stream = merge_async_iterators(*iterators)
            await stream.__anext__()
            await asyncio.sleep(0.01)  # the others wait with items nobody takes
            await stream.aclose()
            for _ in range(5):  # a cancelled task throws into its generator when it runs
                await asyncio.sleep(0)
            assert sorted(closed) == list(range(count))

    asyncio.run(run())


def test_the_server_sends_one_engine_request_with_n() -> None:
    engine = FakeAsyncLLM()
    client = TestClient(build_app(engine, log_stats=False))
    body = {"prompt": "w5 w6", "n": 3, "max_tokens": 2, "seed": 4, "temperature": 1.0}
    for stream in (False, True):
        assert client.post("/v1/completions", json={**body, "stream": stream}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "w5"}], "n": 2, "max_completion_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert [(r["params"].n, r["params"].seed) for r in engine.requests.values()] == [(3, 4), (3, 4), (2, None)]
    assert len(engine.core_requests) == 3 + 3 + 2  # the engine's fan-out, not the server's


def test_echo_with_logprobs_gives_every_choice_the_prompt_logprobs() -> None:
    """The engine computes prompt logprobs once per prompt (its first sequence); every
    choice of that prompt echoes them."""
    engine = FakeAsyncLLM()
    client = TestClient(build_app(engine, log_stats=False))
    body = {"prompt": ["w5 w6", "w7"], "n": 2, "max_tokens": 2, "echo": True, "logprobs": 1, "seed": 3,
            "temperature": 1.0}  # fmt: skip
    whole = client.post("/v1/completions", json=body).json()["choices"]
    events = [json.loads(line[6:]) for line in client.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    streamed: dict[int, list[str]] = {}
    for event in events:
        for choice in event["choices"]:
            streamed.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
    for c in whole:
        prompt_tokens = ["<s>", "w5", "w6"] if c["index"] < 2 else ["<s>", "w7"]
        n = len(prompt_tokens)
        assert c["logprobs"]["tokens"][:n] == prompt_tokens and len(c["logprobs"]["tokens"]) == n + 2
        assert c["logprobs"]["token_logprobs"][0] is None and None not in c["logprobs"]["token_logprobs"][1:]
        assert c["text"].startswith(" ".join(prompt_tokens[1:]))
        assert streamed[c["index"]] == c["logprobs"]["tokens"]
    assert [r["params"].prompt_logprobs for r in engine.requests.values()] == [1, 1, 1, 1]


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_sequences_of_every_prompt(stream: bool) -> None:
    """Several prompts: one stream per prompt, merged; leaving stops them all."""
    engine = FakeAsyncLLM(step_delay=0.02)
    body = {"prompt": ["w5", "w6 w7"], "n": 2, "max_tokens": 60, "ignore_eos": True, "stream": stream}
    with ServerThread(build_app(engine, log_stats=False)) as server:
        with httpx.Client(base_url=server.url, timeout=0.5) as http:
            if stream:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    indexes: set[int] = set()
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            indexes |= {c["index"] for c in json.loads(line[6:])["choices"]}
                        if indexes == {0, 1, 2, 3}:
                            break
            else:
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/completions", json=body)
        assert wait_for(lambda: not engine.active)
    assert len(engine.requests) == 2 and len(engine.core_requests) == 4
    assert sorted(engine.aborted) == sorted(engine.core_requests) and engine.finished == []


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture
def served(model_dir: str) -> Iterator[AsyncLLM]:
    engine = tiny_async_llm(model_dir)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_seeded_n_choices_equal_offline_generate(model_dir: str, served: AsyncLLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    offline = LLM(model_dir, dtype="float32", kv_cache_memory="32MiB").generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:9]}], params, use_tqdm=False
    )
    expected = [c.text for out in offline for c in out.outputs]
    assert len(set(expected[:2])) == 2  # the two choices differ
    body = {"prompt": [PROMPT, PROMPT[:9]], "n": 2, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 8,
            "ignore_eos": True}  # fmt: skip
    with TestClient(build_app(served, log_stats=False)) as client:
        whole = client.post("/v1/completions", json=body).json()
        streamed = client.post("/v1/completions", json={**body, "stream": True}).text
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]  # prompt_index * n + i
    assert [c["text"] for c in whole["choices"]] == expected
    texts = [""] * 4
    for line in streamed.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] += choice["text"]
    assert texts == expected


@pytest.fixture
def served_in_process(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[AsyncLLM]:
    """The engine core in a thread of this process (KVLOOM_ENABLE_MULTIPROCESSING=0), so
    that a test can reach into it."""
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    engine = tiny_async_llm(model_dir)
    try:
        yield engine
    finally:
        engine.shutdown()


def test_disconnecting_from_an_n_stream_aborts_every_child(served_in_process: AsyncLLM,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    served = served_in_process
    core = served.engine_core.core
    step, steps, stall = core.step, [], threading.Event()
    stall.set()

    def stalling_step() -> Any:
        steps.append(1)
        if len(steps) <= 5 or not stall.is_set():
            return step()
        time.sleep(0.005)  # then the requests stall: the stream outlives the client, however slow it reads
        return EngineCoreOutputs()

    monkeypatch.setattr(core, "step", stalling_step)
    aborted: list[str] = []
    abort_requests = served.engine_core.abort_requests

    def spy(request_ids: Any) -> None:
        ids = list(request_ids)
        aborted.extend(ids)
        abort_requests(ids)

    monkeypatch.setattr(served.engine_core, "abort_requests", spy)

    def core_state() -> tuple[int, float]:
        fn = lambda c: (c.scheduler.get_num_unfinished_requests(), c.scheduler.kv_cache_manager.usage)  # noqa: E731
        return served.engine_core.utility(fn).result(timeout=10)

    # logprobs: every token is a chunk, even one whose text is not complete yet.
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 200, "ignore_eos": True, "stream": True, "logprobs": 0}
    with ServerThread(build_app(served, log_stats=False)) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                indexes: set[int] = set()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        indexes |= {c["index"] for c in json.loads(line[6:])["choices"]}
                    if indexes == {0, 1, 2}:
                        assert core_state()[0] == 3 and not aborted  # three children running
                        break  # leaving the line iterator closes the connection mid-stream
            assert wait_for(lambda: core_state() == (0, 0.0))
            assert sorted(aborted) == [f"{i}_{aborted[0].split('_', 1)[1]}" for i in range(3)]
            assert not served.frontend.output_processor.request_states
            stall.clear()
            ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
