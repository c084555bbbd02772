"""`kvloom serve --api-server-count 2`: two API server processes on one port over one
engine core (the launcher in `entrypoints/openai/launcher.py`). The official openai
client against them, requests spread over both, /metrics totals whichever answers, and
the faults: the engine core killed, an API server killed, SIGTERM, the launcher killed.
Each server runs a tiny random Llama."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.engine_faults import descendant_pids, wait_gone
from tests.helpers.plugin_server import KvloomServer
from tests.helpers.served import (
    engine_core_pid,
    long_context_model,
    metric,
    metrics,
    no_process_left,
    pids_in_log,
    serve_args,
)
from tests.helpers.waiting import wait_for

API_KEY = "k"
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_context_model(tmp_path_factory.mktemp("model"))


def api_server_args(model_dir: Path, *extra: str) -> list[str]:
    return serve_args(model_dir, "--api-server-count", "2", *extra)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvloomServer]:
    srv = KvloomServer(api_server_args(model_dir, "--api-key", API_KEY), tmp_path_factory.mktemp("serve"), access_log=True)
    with srv:
        children = descendant_pids(srv.process.pid)
        yield srv
    # Ctrl-C: a clean shutdown of every process.
    assert srv.process.returncode == 0, srv.log()[-5000:]
    assert all(wait_gone(pid) for pid in children)


@pytest.fixture
def own_server(model_dir: Path, tmp_path: Path) -> Iterator[KvloomServer]:
    """A server for one test that ends it (faults)."""
    with KvloomServer(api_server_args(model_dir), tmp_path) as srv:
        # Both API servers are up (the first one answering /health is not enough here).
        assert wait_for(lambda: len(api_server_pids(srv)) == 2, timeout=60)
        yield srv


def api_server_pids(server: KvloomServer) -> dict[int, int]:
    # Logged once an API server has started serving.
    return {i: pid for i, pid in pids_in_log(server, "APIServer").items()
            if f"(APIServer_{i} pid={pid}) INFO:     Application startup complete" in server.log()}  # fmt: skip


# ----------------------------------------------------------------- serving


def test_openai_client_against_two_api_servers(server: KvloomServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    (card,) = client.models.list().data
    model = card.id
    c = client.completions.create(model=model, prompt="Hello world", max_tokens=4, temperature=0, n=2, logprobs=1,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert [ch.index for ch in c.choices] == [0, 1] and c.choices[0].text == c.choices[1].text  # greedy
    assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens > 0
    assert len(c.choices[0].logprobs.tokens) == 4

    chunks = list(client.completions.create(model=model, prompt="Hello world", max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4

    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    assert len(chat.choices[0].logprobs.content) == 3
    streamed = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=3,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == chat.choices[0].message.content

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model=model, prompt="Hi")  # fmt: skip

    # Greedy outputs are the same whichever API server answers.
    texts = {client.completions.create(model=model, prompt="The sky", max_tokens=6, temperature=0).choices[0].text
             for _ in range(6)}  # fmt: skip
    assert len(texts) == 1


def test_requests_spread_over_both_api_servers(server: KvloomServer) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def served_by() -> set[str]:
        return set(re.findall(r"\(APIServer_(\d) pid=\d+\) INFO: +127\.0\.0\.1:\d+ - \"POST /v1/completions",
                              server.log()))  # fmt: skip

    deadline = time.monotonic() + 60
    while served_by() != {"0", "1"} and time.monotonic() < deadline:
        # Concurrent requests on new connections: the kernel hands each to an API server.
        threads = [threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                    kwargs={"json": body, "headers": headers, "timeout": 30}) for _ in range(8)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert served_by() == {"0", "1"}, server.log()[-3000:]
    assert len(set(api_server_pids(server).values())) == 2


def test_metrics_count_the_whole_server_whichever_api_server_answers(server: KvloomServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = metrics(server)
    sent = 10
    threads = [threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                kwargs={"json": {"prompt": f"Hello {i}", "max_tokens": 3, "ignore_eos": True},
                                        "headers": headers, "timeout": 60}) for i in range(sent)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(6):  # each on a new connection, answered by either API server
        after = metrics(server)
        delta = {name: metric(after, name, **labels) - metric(before, name, **labels) for name, labels in (
            ("kvloom:request_success_total", {"finished_reason": "length"}), ("kvloom:generation_tokens_total", {}),
            ("kvloom:request_generation_tokens_count", {}), ("kvloom:prefix_cache_queries_total", {}),
            ("kvloom:prompt_tokens_total", {}))}  # fmt: skip
        assert delta["kvloom:request_success_total"] == sent
        assert delta["kvloom:generation_tokens_total"] == 3 * sent
        assert delta["kvloom:request_generation_tokens_count"] == sent
        # The engine's own counters are counted once, not once per API server.
        assert 0 < delta["kvloom:prefix_cache_queries_total"] <= delta["kvloom:prompt_tokens_total"]
        assert len([k for k in after if k[0] == "kvloom:cache_config_info"]) == 1

    # Engine gauges: the engine's value, not the sum over API servers.
    body = {"prompt": "Hi", "stream": True, **LONG}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:  # fmt: skip
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a closed iterator closes the stream (the request aborts)
        for line in lines:
            if line.startswith("data: {"):
                break
        running = [metric(metrics(server), "kvloom:num_requests_running") for _ in range(4)]
    assert running == [1.0] * 4


# ----------------------------------------------------------------- faults


def test_killed_engine_core_fails_requests_on_every_api_server_and_the_server_exits_1(
    own_server: KvloomServer,
) -> None:
    server = own_server
    children = descendant_pids(server.process.pid)
    (engine_pid,) = pids_in_log(server, "EngineCore").values()
    results: list[list[str]] = []

    def stream() -> None:
        lines: list[str] = []
        with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": "Hello", "stream": True, **LONG},
                          timeout=60) as response:  # fmt: skip
            lines.extend(line for line in response.iter_lines() if line.startswith("data: "))
        results.append(lines)

    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()
    assert wait_for(lambda: metric(metrics(server), "kvloom:num_requests_running") == 6, timeout=60)
    os.kill(engine_pid, signal.SIGKILL)
    # At once (the API servers stop a second after the engine core died): every one says 503.
    assert wait_for(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503, timeout=5, interval=0.05)
    health = [httpx.get(server.url + "/health", timeout=5).status_code for _ in range(4)]
    for t in threads:
        t.join(timeout=30)

    assert len(results) == 6
    for lines in results:  # every stream ends with an error event and [DONE]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == "engine_error" and "engine core died" in error["message"]
    assert health == [503] * 4
    assert server.process.wait(timeout=30) == 1
    no_process_left(server, children)
    log = server.log()
    for i in (0, 1):  # each API server saw the engine core die
        assert re.search(rf"\(APIServer_{i} pid=\d+\) CRITICAL .*The engine core died", log), log[-3000:]


def test_killed_api_server_stops_everything(own_server: KvloomServer) -> None:
    server = own_server
    children = descendant_pids(server.process.pid)
    os.kill(api_server_pids(server)[1], signal.SIGKILL)
    assert server.process.wait(timeout=60) == 1
    no_process_left(server, children)
    assert "API server 1" in server.log() and "was killed by SIGKILL" in server.log()


def test_sigterm_stops_every_process_cleanly(own_server: KvloomServer) -> None:
    server = own_server
    children = descendant_pids(server.process.pid)
    # The engine core (under the fork server on the CPU) and two API servers (and a resource tracker).
    assert engine_core_pid(server) in children and set(api_server_pids(server).values()) <= set(children)
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3}).status_code == 200
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 0, server.log()[-3000:]
    no_process_left(server, children)
    assert "Traceback" not in server.log()


def test_every_process_exits_when_the_launcher_is_killed(own_server: KvloomServer) -> None:
    server = own_server
    children = descendant_pids(server.process.pid)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=10)
    no_process_left(server, children)
