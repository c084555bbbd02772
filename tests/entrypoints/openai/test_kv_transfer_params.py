"""``kv_transfer_params`` on the OpenAI server (vLLM's field, through which a proxy links a
prefill to its decode): a request's reach the engine's ``SamplingParams``; the connector's
reply (the finished output's) is the response's, and a response without one has no such
field; a malformed one is a 400 naming it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvloom.entrypoints.openai.api_server import build_app
from kvloom.outputs import RequestOutput
from kvloom.sampling_params import SamplingParams
from tests.helpers.serve_fakes import FakeAsyncLLM

REPLY = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [[1, 2]]}


class ConnectorReplyingEngine(FakeAsyncLLM):
    """A fake engine whose connector replies ``REPLY`` when a request asked for a remote decode."""

    def add_request(self, request_id: str, prompt: Any, sampling_params: SamplingParams,
                    *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:  # fmt: skip
        outputs = super().add_request(request_id, prompt, sampling_params, *args, **kwargs)
        asked = (sampling_params.kv_transfer_params or {}).get("do_remote_decode")

        async def replying() -> AsyncIterator[RequestOutput]:
            async for output in outputs:
                if output.finished and asked:
                    output.kv_transfer_params = REPLY
                yield output

        return replying()


@pytest.fixture
def setup() -> tuple[ConnectorReplyingEngine, TestClient]:
    engine = ConnectorReplyingEngine()
    return engine, TestClient(build_app(engine, log_stats=False))


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "w1 w2", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": 1}),
])  # fmt: skip
def test_kv_transfer_params_in_and_out(setup: tuple, path: str, body: dict) -> None:
    engine, client = setup
    asked = {"do_remote_decode": True, "do_remote_prefill": False, "remote_host": None}
    response = client.post(path, json={**body, "kv_transfer_params": asked})
    assert response.status_code == 200, response.text
    assert response.json()["kv_transfer_params"] == REPLY
    assert [r["params"].kv_transfer_params for r in engine.requests.values()] == [asked]
    plain = client.post(path, json=body)
    assert plain.status_code == 200 and "kv_transfer_params" not in plain.json()


@pytest.mark.parametrize("value, fragment", [
    ([1], "kv_transfer_params"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode must be true or false"),
])  # fmt: skip
def test_malformed_kv_transfer_params_are_400(setup: tuple, value: Any, fragment: str) -> None:
    engine, client = setup
    response = client.post("/v1/completions", json={"prompt": "w1", "kv_transfer_params": value})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text
    assert engine.requests == {}
