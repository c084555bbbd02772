"""``kvloom router`` in front of two real ``kvloom serve`` instances (the tiny random Llama on
the CPU) sharing prefixes through ``ExampleConnector``'s folder: the prefill instance a
``kv_producer``, the decode instance a ``kv_consumer``.

Through the router, greedy completions and a streamed chat completion give exactly one
plain engine's tokens, and the decode instance computes only the tail the folder did not
hold (its Prometheus counters); an instance's own 400 comes back unchanged; malformed and
mistyped bodies are 4xx in OpenAI's shape, never a 5xx or a hang; and with the decode
instance gone, requests get a 503 naming it. (The servers are shared by the module; the
last test stops the decode instance.)"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from kvloom import LLM, SamplingParams
from kvloom.testing.install import KvloomServer
from kvloom.testing.models import random_prompts, tiny_model_dir
from tests.entrypoints.openai.test_fuzz_server import (
    batch_clients,
    chat,
    completion,
    fuzz_settings,
    hostile_body,
    run_batch,
)
from tests.helpers.served import metric, metrics

BLOCK = 16
MAX_TOKENS = 8
PROMPTS = random_prompts(512, lengths=(50, 37), seed=41)
MESSAGES = [{"role": "user", "content": "Tell me about the prefill and the decode of a long request, please."}]


def _instance_args(folder: Path, role: str) -> list[str]:
    config = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(folder)}}  # fmt: skip
    return [str(tiny_model_dir("llama")), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--block-size", str(BLOCK), "--log-stats-interval", "1000", "--kv-transfer-config", json.dumps(config)]  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KvloomServer, KvloomServer, KvloomServer]]:
    """(prefill instance, decode instance, router), started together."""
    workdir = tmp_path_factory.mktemp("router")
    prefill = KvloomServer(_instance_args(workdir / "kv", "kv_producer"), workdir)
    decode = KvloomServer(_instance_args(workdir / "kv", "kv_consumer"), workdir)
    with prefill, decode:
        router_args = ["--prefill", prefill.url, "--decode", decode.url, "--startup-timeout", "10"]
        with KvloomServer(router_args, workdir, command=[sys.executable, "-m", "kvloom", "router"]) as router:
            yield prefill, decode, router


@pytest.fixture(scope="module")
def plain_engine() -> Any:
    """One engine without a connector, in this process: the tokens to match."""
    with mock.patch.dict(os.environ, {"KVLOOM_ENABLE_MULTIPROCESSING": "0"}):
        return LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                   block_size=BLOCK)  # fmt: skip


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _consumer_counts(decode: KvloomServer) -> tuple[float, float, float]:
    """(prompt tokens, tokens from the connector, tokens from the local prefix cache) so far."""
    values = metrics(decode)
    return (metric(values, "kvloom:prompt_tokens_total"), metric(values, "kvloom:external_prefix_cache_hits_total"),
            metric(values, "kvloom:prefix_cache_hits_total"))  # fmt: skip


def test_greedy_completions_match_one_engine_and_decode_computes_the_tail(servers: tuple, plain_engine: Any) -> None:
    _, decode, router = servers
    want = [o.outputs[0].text for o in plain_engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    for prompt, text in zip(PROMPTS, want):
        before = _consumer_counts(decode)
        response = router.post("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                   "ignore_eos": True})  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == text
        prompt_tokens, external, local = (a - b for a, b in zip(_consumer_counts(decode), before))
        assert prompt_tokens == len(prompt)
        assert (external, local) == ((len(prompt) - 1) // BLOCK * BLOCK, 0)  # it computed only the tail
    assert "kv_transfer_params" not in response.json()  # ExampleConnector replies nothing: none to show


def test_streamed_chat_matches_one_engine(servers: tuple, plain_engine: Any) -> None:
    _, decode, router = servers
    want = plain_engine.chat(MESSAGES, GREEDY)[0].outputs[0].text
    before = _consumer_counts(decode)
    body = {"messages": MESSAGES, "max_completion_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3  # event by event, not one block
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert tuple(a - b for a, b in zip(_consumer_counts(decode), before)) == (
        prompt_tokens, (prompt_tokens - 1) // BLOCK * BLOCK, 0)  # fmt: skip


def test_an_instances_400_comes_through(servers: tuple) -> None:
    _, decode, router = servers
    direct = decode.post("/v1/completions", {"prompt": "hi", "temperature": -1})
    through = router.post("/v1/completions", {"prompt": "hi", "temperature": -1})
    assert through.status_code == direct.status_code == 400
    assert through.json()["error"]["param"] == "temperature" and through.json() == direct.json()
    models = router.get("/v1/models")
    assert models.status_code == 200 and models.json() == decode.get("/v1/models").json()


@seed(41)
@fuzz_settings(examples=60)
@given(batch=st.lists(st.one_of(st.tuples(st.just("/v1/completions"), completion),
                                st.tuples(st.just("/v1/chat/completions"), chat),
                                st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), hostile_body,
                                          st.just("application/json"))), min_size=1, max_size=4))  # fmt: skip
def test_hostile_requests_through_the_router_never_5xx(servers: tuple, batch: list) -> None:
    """The server's fuzz strategies, through the router: every answer a 4xx in OpenAI's
    shape or a well-formed 200, none a 5xx, none late (``run_batch`` checks)."""
    with batch_clients(servers[2].url) as clients:
        run_batch(clients, batch)


def test_decode_gone_is_a_503_naming_it(servers: tuple) -> None:
    _, decode, router = servers
    decode.stop()
    response = router.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == 503 and error["param"] is None
    assert error["message"].startswith("no decode instance is reachable") and decode.url in error["message"]
    health = router.get("/health")
    assert health.status_code == 503 and decode.url in health.json()["error"]["message"]
    assert "Traceback" not in router.log()
