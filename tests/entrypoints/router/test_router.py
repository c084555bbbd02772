"""``kvloom router`` without servers: the instances are fakes behind ``httpx.MockTransport``
and the router's app is called in process. How a request is split (the prefill's body, the
decode's body with the prefill's ``kv_transfer_params``), round robin, an instance that
cannot be reached (skipped, then a 503 naming it), an instance's own error passed through,
streams relayed unchanged, /health, and the router's own 400s."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvloom.entrypoints.cli.main import build_parser
from kvloom.entrypoints.router.app import build_app
from kvloom.entrypoints.router.instances import InstancePool, normalize_url
from kvloom.entrypoints.router.proxy import PREFILL_KV_TRANSFER_PARAMS, decode_request, prefill_request

P0, P1, D0 = "http://prefill-0:8100", "http://prefill-1:8100", "http://decode-0:8200"
SSE = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'


def test_prefill_request_asks_for_one_token_and_a_remote_decode() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 4, "temperature": 0, "kv_transfer_params": {"do_remote_prefill": True}}  # fmt: skip
    assert prefill_request(body) == {"prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0,
                                     "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    assert prefill_request(chat)["max_completion_tokens"] == 1 and prefill_request(chat)["max_tokens"] == 1
    assert prefill_request({"messages": [], "max_completion_tokens": None})["max_completion_tokens"] is None
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is not changed


def test_decode_request_carries_the_prefills_kv_transfer_params() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "kv_transfer_params": {"x": 1}}
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [[3, 4]]}
    assert decode_request(body, {"choices": [], "kv_transfer_params": params}) == {**body, "kv_transfer_params": params}
    without = {"prompt": "hi", "max_tokens": 50, "stream": True}
    assert decode_request(body, {"choices": []}) == without  # a connector that replies nothing
    assert decode_request(body, {"kv_transfer_params": None}) == without
    assert decode_request(body, ["not", "an", "object"]) == without


def test_urls_and_flags() -> None:
    assert normalize_url("127.0.0.1:8100/") == "http://127.0.0.1:8100"
    assert normalize_url("https://h:1") == "https://h:1"
    with pytest.raises(ValueError, match="not an http"):
        normalize_url("ftp://h:1")
    args = build_parser().parse_args(["router", "--prefill", P0, "--prefill", P1, "--decode", D0])
    assert (args.prefill, args.decode, args.port, args.startup_timeout) == ([P0, P1], [D0], 8000, 60.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--prefill", P0])  # no decode instance


class Fakes:
    """Fake instances: each URL's handler, the requests each got, and which are down."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []  # (instance, path, JSON body)
        self.down: set[str] = set()
        self.reply: dict[str, Callable[[str, Any], httpx.Response]] = {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        instance = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if instance in self.down:
            raise httpx.ConnectError("Connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content) if request.content else None
        self.seen.append((instance, request.url.path, body))
        if request.url.path in self.reply:
            return self.reply[request.url.path](instance, body)
        if body["kv_transfer_params"].get("do_remote_decode"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": {"from": instance}})
        if body.get("stream"):
            return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}], "by": instance})


def route(fakes: Fakes, requests: list[tuple[str, str, Any]], prefill: tuple[str, ...] = (P0, P1),
          decode: tuple[str, ...] = (D0,)) -> list[httpx.Response]:  # fmt: skip
    """Send ``requests`` (method, path, JSON body or raw bytes) through a router over ``fakes``
    (method ``DOWN`` / ``UP`` with an instance's URL as the path: it goes away / comes back)."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fakes.handle)) as instances:
            pool = InstancePool(list(prefill), list(decode), instances)
            await pool.wait_until_up(timeout=0)
            transport = httpx.ASGITransport(app=build_app(pool))
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                out = []
                for method, path, body in requests:
                    if method in ("DOWN", "UP"):  # an instance (``path``) goes away or comes back
                        (fakes.down.add if method == "DOWN" else fakes.down.discard)(path)
                        continue
                    raw = body if isinstance(body, bytes) else None
                    out.append(await client.request(method, path, content=raw, json=None if raw else body))
                return out

    return asyncio.run(run())


def test_prefill_then_decode_round_robin() -> None:
    fakes = Fakes()
    body = {"prompt": "hi", "max_tokens": 7}
    first, second = route(fakes, [("POST", "/v1/completions", body)] * 2)
    assert first.status_code == second.status_code == 200
    assert first.json() == {"choices": [{"text": "decoded"}], "by": D0}  # the decode's answer, unchanged
    prefills = [(inst, b) for inst, _, b in fakes.seen if b["max_tokens"] == 1]
    decodes = [(inst, b) for inst, _, b in fakes.seen if b["max_tokens"] == 7]
    assert [inst for inst, _ in prefills] == [P0, P1]  # in turn
    assert decodes == [(D0, {**body, "kv_transfer_params": {"from": P0}}),
                       (D0, {**body, "kv_transfer_params": {"from": P1}})]  # fmt: skip


def test_streams_pass_through_unchanged() -> None:
    fakes = Fakes()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "stream": True}
    (response,) = route(fakes, [("POST", "/v1/chat/completions", chat)])
    assert response.status_code == 200 and response.content == SSE
    assert response.headers["content-type"].startswith("text/event-stream")
    assert [(path, b["stream"], b["max_completion_tokens"]) for _, path, b in fakes.seen] == [
        ("/v1/chat/completions", False, 1), ("/v1/chat/completions", True, 5)]  # fmt: skip


def test_an_unreachable_prefill_is_skipped_and_a_missing_role_is_a_503() -> None:
    fakes = Fakes()
    body = {"prompt": "hi", "max_tokens": 3}
    fakes.down.add(P1)
    responses = route(fakes, [("POST", "/v1/completions", body)] * 3)
    assert [r.status_code for r in responses] == [200] * 3
    assert {inst for inst, _, b in fakes.seen if b["max_tokens"] == 1} == {P0}

    fakes = Fakes()  # a role with no instance up at start stops the router
    fakes.down.update({P0, D0})
    with pytest.raises(ValueError, match="no prefill instance is reachable: http://prefill-0:8100"):
        route(fakes, [], prefill=(P0,))


def test_decode_gone_after_start_is_a_503_naming_it() -> None:
    fakes = Fakes()

    def prefill_then_decode_dies(instance: str, body: Any) -> httpx.Response:
        fakes.down.add(D0)  # the decode instance dies while the prefill runs
        return httpx.Response(200, json={"choices": [], "kv_transfer_params": {"from": instance}})

    fakes.reply["/v1/completions"] = prefill_then_decode_dies
    response, health, models = route(fakes, [("POST", "/v1/completions", {"prompt": "hi"}), ("GET", "/health", None),
                                             ("GET", "/v1/models", None)])  # fmt: skip
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == 503 and error["param"] is None and error["type"] == "service_unavailable_error"
    assert "no decode instance is reachable" in error["message"] and D0 in error["message"]
    assert "ConnectError" in error["message"]
    assert health.status_code == 503 and "decode" in health.json()["error"]["message"]
    assert [i["up"] for i in health.json()["decode"]] == [False] and health.json()["prefill"][0]["up"]
    assert models.status_code == 503


def test_an_instances_own_error_is_the_answer() -> None:
    fakes = Fakes()
    bad = {"error": {"message": "temperature: must be >= 0", "type": "invalid_request_error", "param": "temperature",
                     "code": None}}  # fmt: skip
    fakes.reply["/v1/completions"] = lambda instance, body: httpx.Response(400, json=bad)
    (response,) = route(fakes, [("POST", "/v1/completions", {"prompt": "hi", "temperature": -1})])
    assert response.status_code == 400 and response.json() == bad
    assert len(fakes.seen) == 1  # no decode after the prefill's error


def test_the_routers_own_bad_requests_and_health() -> None:
    fakes = Fakes()
    responses = route(fakes, [("POST", "/v1/completions", b'{"prompt": "hi"'), ("POST", "/v1/completions", b"[1]"),
                              ("POST", "/v1/chat/completions", b""), ("GET", "/v1/completions", None),
                              ("POST", "/v1/nothing", {}), ("GET", "/health", None)])  # fmt: skip
    for response in responses[:5]:
        assert 400 <= response.status_code < 500, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert (
        "JSON" in responses[0].json()["error"]["message"] and "JSON object" in responses[1].json()["error"]["message"]
    )
    assert responses[5].status_code == 200 and [i["url"] for i in responses[5].json()["prefill"]] == [P0, P1]
    assert fakes.seen == []  # nothing bad reached an instance



def test_an_instance_back_up_serves_again_without_waiting() -> None:
    fakes = Fakes()
    request = ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    gone, back, health = route(fakes, [("DOWN", D0, None), request, ("UP", D0, None), request, ("GET", "/health", None)],
                               prefill=(P0,))  # fmt: skip
    assert gone.status_code == 503 and D0 in gone.json()["error"]["message"]
    assert back.status_code == 200  # the role had none up: checked again at once, not after the interval
    assert health.status_code == 200
