"""`kvloom serve --data-parallel-size 2`: two engine cores behind one API server (its
AsyncMPClient starts both) and behind two API servers (the launcher starts them): the
greedy tokens of one engine, requests on both engines, /metrics per engine, and an
engine core killed. Each server runs a tiny random Llama on the CPU."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest

from kvloom import LLM, SamplingParams
from tests.helpers.engine_faults import child_pids
from tests.helpers.model_fixtures import random_prompts
from tests.helpers.plugin_server import KvloomServer
from tests.helpers.served import long_context_model, metric, metrics, no_process_left, pids_in_log, serve_args
from tests.helpers.waiting import wait_for

PROMPTS = random_prompts(320, lengths=(5, 16, 23, 41, 64, 7, 30, 12))
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_context_model(tmp_path_factory.mktemp("model"))


def dp_args(model_dir: Path, *extra: str) -> list[str]:
    return serve_args(model_dir, "--data-parallel-size", "2", *extra)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[str]:
    """The greedy completion of each prompt by one engine core."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=4096, disable_log_stats=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    llm.llm_engine.shutdown()
    return texts


def served_texts(server: KvloomServer) -> list[str]:
    """The prompts (token ids) sent concurrently, so that both engines get some: greedy completions."""
    results: dict[int, str] = {}

    def one(i: int) -> None:
        body = {"prompt": PROMPTS[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        results[i] = response.json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[i] for i in range(len(PROMPTS))]


def engine_queries(server: KvloomServer) -> list[float]:
    """Prompt tokens each engine core looked up in its prefix cache: > 0 once it served a request."""
    values = metrics(server)
    return [metric(values, "kvloom:prefix_cache_queries_total", engine=str(e)) for e in range(2)]


def test_one_api_server_over_two_engine_cores(model_dir: Path, tmp_path: Path, expected: list[str]) -> None:
    with KvloomServer(dp_args(model_dir), tmp_path) as server:
        assert served_texts(server) == expected
        assert all(q > 0 for q in engine_queries(server)), engine_queries(server)  # both engines served
        assert "with 1 API server and 2 engine cores" in server.log()
        assert sorted(pids_in_log(server, "EngineCore")) == [0, 1]


def test_two_api_servers_over_two_engine_cores(model_dir: Path, tmp_path: Path, expected: list[str]) -> None:
    with KvloomServer(dp_args(model_dir, "--api-server-count", "2"), tmp_path) as server:
        children = child_pids(server.process.pid)
        assert served_texts(server) == expected
        assert served_texts(server) == expected
        values = metrics(server)  # whichever API server answers: the whole server
        assert metric(values, "kvloom:request_success_total", finished_reason="length") == 2 * len(PROMPTS)
        assert all(q > 0 for q in engine_queries(server))
        assert "with 2 API servers and 2 engine cores" in server.log()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    no_process_left(server, children)


def test_a_killed_engine_core_of_two_fails_open_requests_and_the_server_exits_1(
    model_dir: Path, tmp_path: Path
) -> None:
    with KvloomServer(dp_args(model_dir), tmp_path) as server:
        children = child_pids(server.process.pid)
        engine_pids = pids_in_log(server, "EngineCore")
        results: list[list[str]] = []

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions",
                              json={"prompt": "Hello", "stream": True, **LONG}, timeout=60) as response:  # fmt: skip
                results.append([line for line in response.iter_lines() if line.startswith("data: ")])

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        # Both engines run requests; then engine core 1 dies.
        assert wait_for(lambda: all(metric(metrics(server), "kvloom:num_requests_running", engine=str(e)) > 0
                                    for e in range(2)), timeout=60)  # fmt: skip
        os.kill(engine_pids[1], signal.SIGKILL)
        assert wait_for(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503, timeout=5,
                        interval=0.05)  # fmt: skip
        for t in threads:
            t.join(timeout=30)
        assert len(results) == 4
        for lines in results:  # every open request failed, on either engine
            assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "engine_error"
        assert server.process.wait(timeout=30) == 1
    no_process_left(server, children)  # the other engine core included
    assert re.search(rf"The engine core process \(pid {engine_pids[1]}\) was killed by SIGKILL", server.log())
