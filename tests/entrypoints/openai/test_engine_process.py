"""`kvloom serve` with its engine core in a separate process: what happens when that
process dies (SIGKILL mid-stream), when the server is stopped (SIGTERM), and when the
server itself is killed. Each test runs its own server on a tiny random Llama."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.engine_faults import descendant_pids
from tests.helpers.plugin_server import KvloomServer
from tests.helpers.served import engine_core_pid, long_context_model, no_process_left, serve_args

#: Long enough to still run when the engine core is killed (a few ms a token).
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_context_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def server(model_dir: Path, tmp_path: Path) -> Iterator[KvloomServer]:
    args = serve_args(model_dir)
    with KvloomServer(args, tmp_path) as srv:
        yield srv


def test_killed_engine_core_fails_open_requests_and_the_server_exits(server: KvloomServer) -> None:
    engine_pid = engine_core_pid(server)
    children = descendant_pids(server.process.pid)
    url = server.url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    whole: dict = {}

    def whole_request() -> None:
        response = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "The capital of", **LONG},
                              timeout=60)  # fmt: skip
        whole["status"], whole["body"] = response.status_code, response.json()

    stream_lines: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {"model": model, "prompt": "Hello world", "stream": True, **LONG}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:  # the stream is running
                if line.startswith("data: {"):
                    break
            thread = threading.Thread(target=whole_request)
            thread.start()
            time.sleep(0.3)  # the whole request is in the engine too
            signal_time = time.monotonic()
            os.kill(engine_pid, signal.SIGKILL)
            stream_lines = [line for line in lines if line.startswith("data: ")]
            stream_ended = time.monotonic() - signal_time
            health = httpx.get(url + "/health", timeout=5)
    thread.join(timeout=30)

    # The stream ends at once with an error event (and [DONE]).
    assert stream_ended < 5
    events = [json.loads(line[6:]) for line in stream_lines if line != "data: [DONE]"]
    assert stream_lines[-1] == "data: [DONE]" and "error" in events[-1]
    assert "engine core" in events[-1]["error"]["message"].lower()
    # The whole response is a 500 with OpenAI's error body.
    assert whole["status"] == 500, whole
    assert set(whole["body"]["error"]) >= {"message", "type", "code"} and whole["body"]["error"]["code"] == "engine_error"
    assert "engine core died" in whole["body"]["error"]["message"]  # the cause is in the log only
    assert health.status_code == 503 and "error" in health.json()
    # The server exits non-zero by itself, and no process is left behind.
    assert server.process.wait(timeout=15) != 0
    no_process_left(server, children, timeout=10)
    assert "The engine core died" in server.log() and "SIGKILL" in server.log()


def test_sigterm_shuts_the_server_and_its_engine_core_down_cleanly(server: KvloomServer) -> None:
    children = descendant_pids(server.process.pid)
    assert engine_core_pid(server) in children
    ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0, server.log()[-3000:]
    no_process_left(server, children, timeout=10)
    assert "Traceback" not in server.log()


def test_the_engine_core_exits_when_the_server_is_killed(server: KvloomServer) -> None:
    children = descendant_pids(server.process.pid)
    assert engine_core_pid(server) in children
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=10)
    no_process_left(server, children, timeout=10)  # the engine core notices its parent is gone
