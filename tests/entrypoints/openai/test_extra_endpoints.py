"""/ping, Anthropic's x-api-key header, and endpoint plugins (routes behind the API key,
loaded only when KVLOOM_PLUGINS names them, refused when they clash with the server's)."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, Request
from fastapi.testclient import TestClient

from kvloom import plugins
from kvloom.entrypoint_plugin import EndpointPlugin
from kvloom.entrypoints.openai.api_server import build_app
from kvloom.entrypoints.openai.errors import APIError
from kvloom.entrypoints.openai.routers.shared import server_context
from kvloom_registry import PluginEntry
from tests.helpers.serve_fakes import FakeAsyncLLM


class Echo(EndpointPlugin):
    name = "echo"

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.post("/echo")
        async def echo(request: Request) -> dict:
            body = await server_context(request.app).read_json(request)
            if not isinstance(body, dict):
                raise APIError("body: must be an object", param="body")
            return {"model": server_context(request.app).engine.config.model.served_model_name, "echo": body}

        return router


class Clash(Echo):
    name = "clash"

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/completions", lambda: {}, methods=["POST"])
        return router


def entry(cls: type[EndpointPlugin]) -> PluginEntry:
    return PluginEntry(cls.name, plugins.ENDPOINT_PLUGINS, "fake-dist", "1.0", f"x:{cls.__name__}", cls)


def test_ping_answers_like_health() -> None:
    engine = FakeAsyncLLM()
    client = TestClient(build_app(engine, api_key="k", log_stats=False))
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
    engine.healthy = False
    response = client.get("/ping")
    assert response.status_code == 503 and "Engine is not healthy" in response.json()["error"]["message"]


def test_the_api_key_as_bearer_or_x_api_key() -> None:
    client = TestClient(build_app(FakeAsyncLLM(), api_key="k", log_stats=False))
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/v1/models", headers={"x-api-key": "k"}).status_code == 200
    assert client.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


def test_an_endpoint_plugin_serves_behind_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "endpoint_plugins", lambda: [entry(Echo)])
    client = TestClient(build_app(FakeAsyncLLM(), api_key="k", log_stats=False))
    assert client.post("/echo", json={"a": 1}).status_code == 401
    response = client.post("/echo", json={"a": 1}, headers={"Authorization": "Bearer k"})
    assert response.json() == {"model": "fake-model", "echo": {"a": 1}}
    bad = client.post("/echo", json=[1], headers={"Authorization": "Bearer k"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    deep = client.post("/echo", content="[" * 100 + "]" * 100,
                       headers={"Authorization": "Bearer k", "Content-Type": "application/json"})  # fmt: skip
    assert deep.status_code == 400  # the server's JSON limits hold for plugins too
    form = client.post("/echo", content="a=1", headers={"Authorization": "Bearer k",
                                                        "Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415


def test_an_endpoint_plugin_may_not_take_the_servers_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "endpoint_plugins", lambda: [entry(Clash)])
    with pytest.raises(ValueError, match=r"plugin 'clash' .*its routes POST /v1/completions are the server's own"):
        build_app(FakeAsyncLLM(), log_stats=False)
