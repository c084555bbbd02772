"""What a hostile client sends is a 4xx, never a 500 or a stall (the fake engine; the
fuzz suite, ``test_fuzz_server.py``, does the same against a real ``kvloom serve``).

The cases of the hostile-client run: bodies that crashed the parser (100,000 nested
``[``, a 5,000-digit integer), lone UTF-16 surrogates, 500s that echoed exception text,
bodies that took the event loop for seconds, a streamed request with bad input answered
200, a ``text/plain`` body executed as JSON, ``/tokenize`` outside the API key.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvloom.entrypoints.openai.api_server import build_app
from kvloom.entrypoints.openai.limits import OFFLOAD_CHARS, ServerLimits, default_max_body_bytes
from tests.entrypoints.openai.test_server import assert_error, post
from tests.helpers.serve_fakes import FakeAsyncLLM, ServerThread

CHAT = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture
def client(engine: FakeAsyncLLM) -> TestClient:
    return TestClient(build_app(engine, log_stats=False), raise_server_exceptions=False)


def raw_post(client: TestClient, path: str, body: bytes, content_type: str | None = "application/json",
             **headers: str) -> httpx.Response:  # fmt: skip
    if content_type is not None:
        headers["Content-Type"] = content_type
    return client.post(path, content=body, headers=headers)


# ----------------------------------------------------------------- the parser


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/pooling"])
def test_deep_nesting_is_a_400(client: TestClient, path: str) -> None:
    err = assert_error(raw_post(client, path, b"[" * 100_000), 400, "nest more than 64 levels deep")
    assert err["code"] == "invalid_json"
    nested = b'{"prompt": "w5", "user": ' + b"[" * 64 + b"]" * 64 + b"}"
    assert_error(raw_post(client, path, nested), 400, "nest more than 64 levels deep (at user")


def test_long_numbers_and_non_json_constants_are_400s(client: TestClient) -> None:
    for body, fragment in [
        (b'{"prompt": "w5", "max_tokens": ' + b"9" * 5000 + b"}", "a number has 5000 characters, more than the 100"),
        (b'{"prompt": "w5", "top_k": 1' + b"0" * 100 + b"}", "a number has 101 characters"),
        (b'{"prompt": "w5", "temperature": 0.' + b"5" * 200 + b"}", "a number has 202 characters"),
        (b'{"prompt": "w5", "temperature": NaN}', "NaN is not a JSON value"),
        (b'{"prompt": "w5", "temperature": -Infinity}', "-Infinity is not a JSON value"),
    ]:
        err = assert_error(raw_post(client, "/v1/completions", body), 400, fragment)
        assert err["code"] == "invalid_json"
    # Long digit runs inside strings are text, not numbers.
    ok = raw_post(client, "/v1/completions", b'{"prompt": "w5 ' + b"7" * 500 + b'", "max_tokens": 1}')
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", b'{"prompt": "w5 \\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["w5", "\\udfff w6"]}', "prompt[1]"),
        ("/v1/completions", b'{"prompt": "w5", "stop": ["\\ud83d"]}', "stop[0]"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
        ("/v1/chat/completions", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "w5"}]}', "model"),
        ("/tokenize", b'{"prompt": "\\udc00"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         "messages[0].content[0].text"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(client: TestClient, path: str, body: bytes, param: str) -> None:
    err = assert_error(raw_post(client, path, body), 400, f"{param}: is not valid Unicode", "lone UTF-16 surrogate",
                       param=param)  # fmt: skip
    assert err["code"] == "invalid_value"
    assert_error(raw_post(client, path, b'{"\\ud800": 1}'), 400, "body: an object key is not valid Unicode")


# ----------------------------------------------------------------- 500s


def test_500s_say_internal_error_with_the_request_id_and_log_the_details(
    client: TestClient, engine: FakeAsyncLLM, caplog: pytest.LogCaptureFixture
) -> None:
    def secret_failure(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("secret internal detail")

    engine.add_request = secret_failure  # type: ignore[method-assign]
    for path, body in (("/v1/completions", {"prompt": "w5"}), ("/v1/chat/completions", CHAT)):
        err = assert_error(post(client, path, body), 500, "Internal server error (request id: ")
        assert "secret" not in err["message"] and err["type"] == "server_error" and err["code"] == "internal_error"
    # An error outside the engine path: the id is the HTTP request's (X-Request-Id).
    import kvloom.entrypoints.openai.serving_models as serving_models

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serving_models.OpenAIServingModels, "model_list", secret_failure)
        r = client.get("/v1/models", headers={"X-Request-Id": "my-trace-1"})
        err = assert_error(r, 500, "Internal server error (request id: my-trace-1)")
        assert r.headers["x-request-id"] == "my-trace-1" and "secret" not in r.text
        r = client.get("/v1/models", headers={"X-Request-Id": "bad id\u00e9".encode("latin-1")})  # not a sane id: a new one
        assert r.headers["x-request-id"].startswith("req-") and r.headers["x-request-id"] in r.json()["error"]["message"]
    assert caplog.text.count("secret internal detail") >= 3


# ----------------------------------------------------------------- limits


def test_body_size_limit_is_a_413(engine: FakeAsyncLLM) -> None:
    client = TestClient(build_app(engine, log_stats=False, limits=ServerLimits(max_request_body_bytes=4096)))
    small = json.dumps({"prompt": "w5 " * 10, "max_tokens": 1, "user": "x" * 3000}).encode()
    assert raw_post(client, "/v1/completions", small).status_code == 200
    big = json.dumps({"prompt": "w5 " * 2000}).encode()
    for path in ("/v1/completions", "/tokenize", "/v1/chat/completions"):
        err = assert_error(raw_post(client, path, big), 413, "Request body too large", "at most 4096 bytes")
        assert err["code"] == "request_too_large"

    def chunks() -> Any:  # no Content-Length: refused once the limit is passed
        for _ in range(10):
            yield b" " * 1000

    assert_error(client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    # The default fits a prompt of max_model_len tokens written out as JSON, and a few MB.
    assert default_max_body_bytes(64) == 4 * 2**20 and default_max_body_bytes(131072) == 16 * 2**20


def test_prompts_times_n_is_limited(engine: FakeAsyncLLM) -> None:
    client = TestClient(build_app(engine, log_stats=False, limits=ServerLimits(max_sequences_per_request=8)))
    assert post(client, "/v1/completions", {"prompt": ["w5", "w6"], "n": 4, "max_tokens": 1}).status_code == 200
    engine.requests.clear()
    assert_error(post(client, "/v1/completions", {"prompt": ["w5", "w6", "w7"], "n": 3, "max_tokens": 1}), 400,
                 "prompt: 3 prompt(s) x n=3 make 9 sequences", "prompts x n <= 8", param="prompt")  # fmt: skip
    assert_error(post(client, "/v1/completions", {"prompt": [[5]] * 9, "max_tokens": 1}), 400, "9 sequences")
    assert_error(post(client, "/v1/chat/completions", {**CHAT, "n": 9}), 400, "n: 1 prompt(s) x n=9", param="n")
    assert not engine.requests  # nothing was started
    # The hostile run's 250 prompts x n=128 from one small body, under the default limit.
    default = TestClient(build_app(engine, log_stats=False))
    assert_error(post(default, "/v1/completions", {"prompt": ["w5"] * 250, "n": 128}), 400,
                 "250 prompt(s) x n=128 make 32000 sequences", "prompts x n <= 256")  # fmt: skip


# ----------------------------------------------------------------- content types and the key


@pytest.mark.parametrize(
    "content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=x", "application/octet-stream"]  # fmt: skip
)
def test_bodies_that_are_not_json_are_a_415(client: TestClient, engine: FakeAsyncLLM, content_type: str) -> None:
    body = json.dumps({"prompt": "w5", "max_tokens": 1}).encode()
    for path in ("/v1/completions", "/tokenize", "/v1/chat/completions"):
        err = assert_error(raw_post(client, path, body, content_type), 415, "Unsupported Content-Type",
                           "application/json")  # fmt: skip
        assert err["code"] == "unsupported_media_type"
    assert not engine.requests


def test_json_and_missing_content_types_are_accepted(client: TestClient) -> None:
    body = json.dumps({"prompt": "w5", "max_tokens": 1}).encode()
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                         "application/vnd.api+json", None):  # fmt: skip
        assert raw_post(client, "/v1/completions", body, content_type).status_code == 200, content_type


def test_everything_that_runs_model_code_needs_the_key(engine: FakeAsyncLLM) -> None:
    client = TestClient(build_app(engine, api_key="sekrit", log_stats=False))
    for path, body in [("/tokenize", {"prompt": "w5"}), ("/detokenize", {"tokens": [5]}), ("/pooling", {"input": "w5"}),
                       ("/v1/completions", {"prompt": "w5"}), ("/v1/embeddings", {"input": "w5"})]:  # fmt: skip
        assert_error(post(client, path, body), 401, "API key")
    auth = {"Authorization": "Bearer sekrit"}
    assert post(client, "/tokenize", {"prompt": "w5"}, headers=auth).json()["tokens"] == [1, 5]
    assert post(client, "/detokenize", {"tokens": [5]}, headers=auth).json() == {"prompt": "w5"}
    for path in ("/health", "/metrics", "/version"):  # operational, open as in vLLM
        assert client.get(path).status_code == 200


# ----------------------------------------------------------------- streams


def test_a_stream_with_bad_input_is_a_400_not_a_200(client: TestClient) -> None:
    for body, fragment in [
        ({"prompt": [5, 7, 1000], "stream": True}, "prompt: token id 1000 is out of range"),
        ({"prompt": "w5", "stream": True, "top_k": 10**20}, "top_k: 100000000000000000000 is out of range"),
        ({"prompt": " ".join(["w5"] * 70), "stream": True}, "maximum context length is 64"),
    ]:
        assert_error(post(client, "/v1/completions", body), 400, fragment)
    assert_error(post(client, "/v1/chat/completions", {**CHAT, "stream": True, "stop_token_ids": [999]}), 400,
                 "stop_token_ids: token id 999")  # fmt: skip


def test_a_stream_is_admitted_before_its_first_byte(client: TestClient, engine: FakeAsyncLLM) -> None:
    seen_before_body = {}
    add_request = engine.add_request

    def recording(request_id: str, *args: Any, **kwargs: Any) -> Any:
        stream = add_request(request_id, *args, **kwargs)
        seen_before_body[request_id] = True
        return stream

    engine.add_request = recording  # type: ignore[method-assign]
    with client.stream("POST", "/v1/completions", json={"prompt": ["w5", "w6"], "stream": True, "max_tokens": 2}) as r:
        assert r.status_code == 200 and len(seen_before_body) == 2  # both admitted when the headers arrive
        assert r.read().endswith(b"data: [DONE]\n\n")


# ----------------------------------------------------------------- the event loop stays free


def test_large_inputs_are_tokenized_off_the_event_loop(engine: FakeAsyncLLM) -> None:
    """A prompt that takes the tokenizer 2 s does not hold /health (nor other requests)."""
    encode = engine.tokenizer.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > OFFLOAD_CHARS:
            time.sleep(2.0)
        return encode(text, add_special_tokens)

    engine.tokenizer.encode = slow_encode  # type: ignore[method-assign]
    big = "w5 " * (OFFLOAD_CHARS // 2)
    with ServerThread(build_app(engine, log_stats=False)) as server:
        results: dict[str, Any] = {}

        def send(name: str, path: str, body: dict) -> None:
            results[name] = httpx.post(server.url + path, json=body, timeout=30)

        threads = [threading.Thread(target=send, args=("completion", "/v1/completions", {"prompt": big})),
                   threading.Thread(target=send, args=("tokenize", "/tokenize", {"prompt": big}))]  # fmt: skip
        for t in threads:
            t.start()
        time.sleep(0.3)  # both are tokenizing now
        start = time.monotonic()
        health = httpx.get(server.url + "/health", timeout=30)
        small = httpx.post(server.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 1}, timeout=30)
        elapsed = time.monotonic() - start
        for t in threads:
            t.join()
    assert health.status_code == 200 and small.status_code == 200 and elapsed < 1.0, elapsed
    assert results["completion"].status_code == 400  # too long for the 64-token context, found off the loop
    assert results["tokenize"].status_code == 200 and results["tokenize"].json()["count"] == OFFLOAD_CHARS // 2 + 1


def test_a_huge_prompt_is_refused_after_tokenizing_a_prefix(engine: FakeAsyncLLM) -> None:
    lengths: list[int] = []
    encode = engine.tokenizer.encode

    def counting_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        lengths.append(len(text))
        return encode(text, add_special_tokens)

    engine.tokenizer.encode = counting_encode  # type: ignore[method-assign]
    client = TestClient(build_app(engine, log_stats=False))
    huge = "w5 " * 300_000  # 900,000 characters for a 64-token context
    assert_error(post(client, "/v1/completions", {"prompt": huge}), 400, "prompt: the prompt has more than",
                 "maximum context length is 64 tokens")  # fmt: skip
    assert lengths == [16 * 64]  # only a prefix was tokenized


def test_logit_bias_reaches_the_engine(client: TestClient, engine: FakeAsyncLLM) -> None:
    assert post(client, "/v1/completions", {"prompt": "w5", "max_tokens": 1, "logit_bias": {"7": -100, "8": 2.5}}).status_code == 200
    (request,) = engine.requests.values()
    assert request["params"].logit_bias == {7: -100.0, 8: 2.5}


def test_a_stream_whose_client_is_gone_before_it_starts_aborts_its_requests(engine: FakeAsyncLLM) -> None:
    """The requests are admitted before the first byte; a client gone before the stream's
    first chunk (the headers cannot be sent) still has them closed (aborted), at once."""
    import asyncio

    closed: list[str] = []
    add_request = engine.add_request

    class Tracked:
        def __init__(self, request_id: str, stream: Any) -> None:
            self.request_id, self.stream = request_id, stream

        def __aiter__(self) -> Any:
            return self

        async def __anext__(self) -> Any:
            return await self.stream.__anext__()

        async def aclose(self) -> None:
            closed.append(self.request_id)
            await self.stream.aclose()

    engine.add_request = lambda request_id, *a, **k: Tracked(request_id, add_request(request_id, *a, **k))  # type: ignore[method-assign]
    app = build_app(engine, log_stats=False)
    body = json.dumps({"prompt": ["w5", "w6"], "stream": True, "max_tokens": 50}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            raise OSError("the client is gone")

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:
            pass

    asyncio.run(run())
    assert sorted(closed) == sorted({r for r in closed}) and len(set(closed)) == 2, closed


# ----------------------------------------------------------------- the newer endpoints

#: Issue 36's endpoints, each with a body it accepts.
NEW_ENDPOINTS = [
    ("/v1/responses", {"input": "w5", "max_output_tokens": 2}),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "w5"}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "w5"}]}),
    ("/v1/score", {"text_1": "w5", "text_2": ["w6"]}),
    ("/score", {"text_1": "w5", "text_2": ["w6"]}),
    ("/v1/rerank", {"query": "w5", "documents": ["w6"]}),
    ("/rerank", {"query": "w5", "documents": ["w6"]}),
    ("/v2/rerank", {"query": "w5", "documents": ["w6"]}),
]


def error_message(response: httpx.Response, status: int) -> str:
    """The message of an error in OpenAI's shape, or Anthropic's on /v1/messages."""
    assert response.status_code == status, response.text
    body = response.json()
    if response.request.url.path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


@pytest.mark.parametrize("path,body", NEW_ENDPOINTS)
def test_the_new_endpoints_refuse_what_the_others_refuse(engine: FakeAsyncLLM, path: str, body: dict) -> None:
    client = TestClient(build_app(engine, api_key="k", log_stats=False, limits=ServerLimits(max_request_body_bytes=4096)),
                        raise_server_exceptions=False)  # fmt: skip
    auth = {"Authorization": "Bearer k"}
    assert "API key" in error_message(client.post(path, json=body), 401)
    assert "nest more than 64 levels deep" in error_message(raw_post(client, path, b"[" * 200 + b"]" * 200, **auth), 400)
    digits = json.dumps(body).encode()[:-1] + b', "x": ' + b"9" * 500 + b"}"
    assert "a number has 500 characters" in error_message(raw_post(client, path, digits, **auth), 400)
    surrogate = json.dumps({**body, "model": "\ud800"}, ensure_ascii=True).encode()
    assert "UTF-16 surrogate" in error_message(raw_post(client, path, surrogate, **auth), 400)
    big = json.dumps({**body, "user": "x" * 5000}).encode()
    assert "Request body too large" in error_message(raw_post(client, path, big, **auth), 413)
    plain = raw_post(client, path, json.dumps(body).encode(), "text/plain", **auth)
    assert plain.status_code == 415 and not engine.requests
    assert error_message(post(client, path, [body], headers=auth), 400)  # a list is no request


def test_a_bad_stream_on_the_new_endpoints_is_a_400_before_any_event(client: TestClient) -> None:
    responses = post(client, "/v1/responses", {"input": "w5", "stream": True, "max_output_tokens": 1000})
    assert "max_output_tokens: 1000 is too large" in error_message(responses, 400)
    messages = post(client, "/v1/messages", {"max_tokens": 1000, "stream": True,
                                             "messages": [{"role": "user", "content": "w5"}]})  # fmt: skip
    assert "max_tokens: 1000 is too large" in error_message(messages, 400)
