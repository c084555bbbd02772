"""Fuzzing a real ``kvloom serve`` (the tiny random Llama, CPU): whatever a client sends,
the server answers with no 5xx, never hangs, and leaves no request or KV block behind.

Hypothesis generates request bodies over the OpenAI schemas (completions, chat
completions, tokenize/detokenize, embeddings, responses, score and rerank) and Anthropic's
(messages, count_tokens), mixing valid values with the edges and
the invalid (out-of-range numbers, huge integers, wrong types, unknown fields, lone UTF-16
surrogates, token ids outside the vocabulary, too many sequences), plus raw hostile bodies
(malformed and deeply nested JSON, long numbers, NaN, non-JSON content types, oversized
bodies) and clients that disconnect mid-stream. Each example is a batch of requests sent
concurrently, so that valid and invalid requests share engine steps.

Checks per response: status < 500, an answer within ``REQUEST_TIMEOUT_S``, a 4xx in
OpenAI's error shape (Anthropic's on /v1/messages), a 200 well formed (choices for every
prompt x n, streams ending in ``[DONE]`` (or the API's last event) with no error event). At the end: /health is 200, /metrics shows no request
running or waiting and no KV block in use, and the server's log has no unhandled error.

``KVLOOM_FUZZ_EXAMPLES`` scales the number of examples (default: enough for more than
4,000 requests, about a minute on a 2-core CPU); ``KVLOOM_FUZZ_SEED`` picks another
deterministic sequence of examples.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.model_fixtures import tiny_model_dir
from tests.helpers.plugin_server import KvloomServer

MAX_MODEL_LEN = 96
VOCAB = 512  # the tiny Llama's
MODEL = "fuzz-model"
REQUEST_TIMEOUT_S = 60.0
BODY_LIMIT = 256 * 1024
MAX_SEQUENCES = 16
EXAMPLES = int(os.environ.get("KVLOOM_FUZZ_EXAMPLES", "0")) or None
SEED = int(os.environ.get("KVLOOM_FUZZ_SEED", "20260101"))
MIN_REQUESTS = 2000
MAX_BATCH = 8  # requests sent at once by one example

#: What the suite sent and got: status codes, requests, failures (kept for the summary).
STATS: Counter[str] = Counter()
ERRORS: Counter[str] = Counter()  # by status and param


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvloomServer]:
    args = [str(tiny_model_dir("llama")), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--served-model-name", MODEL, "--kv-cache-memory", "16MiB", "--max-num-seqs", "16",
            "--max-request-body-bytes", str(BODY_LIMIT), "--max-sequences-per-request", str(MAX_SEQUENCES),
            "--log-stats-interval", "1000"]  # fmt: skip
    with KvloomServer(args, tmp_path_factory.mktemp("fuzz")) as srv:
        yield srv


@contextmanager
def batch_clients(url: str) -> Iterator[list[httpx.Client]]:
    """One keep-alive client per request of a batch (``run_batch``): no two threads share a
    connection pool. httpcore's pool, shared by threads, can close an idle connection that
    another thread has just been handed (encode/httpcore#1110); that thread's read then
    fails with EBADF on its own side of the socket, which is no answer of the server's."""
    with ExitStack() as stack:
        yield [stack.enter_context(httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)) for _ in range(MAX_BATCH)]


@pytest.fixture(scope="module")
def clients(server: KvloomServer) -> Iterator[list[httpx.Client]]:
    with batch_clients(server.url) as opened:
        yield opened


# ----------------------------------------------------------------- strategies

ints = st.one_of(
    st.integers(-3, 8),
    st.sampled_from([0, 1, -1, 20, 21, 128, 129, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64,
                     -(2**63), 1180591620717411303424, 10**30]),  # fmt: skip
    st.integers(),
)
small_count = st.one_of(st.integers(1, 3), ints)
floats = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, -0.0, 1e-6, 2.0, -2.0, 100.0, 100.5, 1e308, -1e308, 1e-320]),
    st.floats(allow_nan=False, allow_infinity=False),
)
surrogate = st.sampled_from(["\ud800", "\udfff", "ok \udc80 ok", "\ud83d"])
texts = st.one_of(
    st.sampled_from(["", " ", "Hello", "The capital of France is", "w" * 300, "\x00", "\u202e", "😀 ünïcode"]),
    st.text(max_size=40),
    surrogate,
)
token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(-4, VOCAB + 4), st.sampled_from([2**31, 2**63, -(2**63)]))
token_ids = st.lists(token_id, min_size=0, max_size=12)
any_json = st.recursive(
    st.none() | st.booleans() | ints | floats | texts,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6,
)
prompt = st.one_of(
    texts,
    st.lists(texts, min_size=0, max_size=4),
    token_ids,
    st.lists(token_ids, min_size=0, max_size=4),
    any_json,
)
stop = st.one_of(st.none(), texts, st.lists(texts, max_size=4), st.lists(st.just("x"), min_size=65, max_size=66),
                 st.just("s" * 1025), any_json)  # fmt: skip
logit_bias = st.one_of(
    st.none(),
    st.dictionaries(st.one_of(st.integers(-2, VOCAB + 2).map(str), texts), st.one_of(floats, st.integers(-101, 101)),
                    max_size=4),  # fmt: skip
    any_json,
)
max_tokens = st.one_of(st.integers(1, 4), st.none(), ints)
model = st.one_of(st.none(), st.just(MODEL), st.just(MODEL), texts)

sampling_fields = {
    "model": model,
    "n": small_count,
    "temperature": st.one_of(st.just(0.0), floats, any_json),
    "top_p": floats,
    "top_k": st.one_of(st.sampled_from([-2, -1, 0, 1, 5, VOCAB, VOCAB + 1, 1180591620717411303424]), ints),
    "min_p": floats,
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "seed": st.one_of(ints, st.none()),
    "stop": stop,
    "stop_token_ids": st.one_of(st.none(), token_ids, st.lists(st.just(7), min_size=1025, max_size=1025)),
    "ignore_eos": st.booleans(),
    "min_tokens": st.one_of(st.integers(0, 3), ints),
    "logit_bias": logit_bias,
    "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True}), any_json),
    "user": texts,
    "priority": st.one_of(st.just(0), ints),
    "cache_salt": texts,
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "kv_transfer_params": st.one_of(st.just({"do_remote_decode": True, "do_remote_prefill": False}), any_json),
    "bogus_field": any_json,
}

completion = st.fixed_dictionaries(
    {"prompt": prompt, "max_tokens": max_tokens},
    optional={**sampling_fields, "logprobs": st.one_of(st.integers(-1, 21), ints), "echo": st.booleans(),
              "best_of": small_count, "suffix": texts, "prompt_logprobs": st.one_of(st.integers(-1, 21), ints)},
)  # fmt: skip

content = st.one_of(texts, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                               max_size=3), any_json)  # fmt: skip
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]), texts),
     "content": content},
    optional={"name": texts, "tool_calls": any_json},
)  # fmt: skip
chat = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=0), any_json),
     "max_completion_tokens": max_tokens},
    optional={**sampling_fields, "max_tokens": max_tokens, "logprobs": st.booleans(),
              "top_logprobs": st.one_of(st.integers(-1, 21), ints), "add_generation_prompt": st.booleans(),
              "tools": any_json, "tool_choice": any_json, "response_format": any_json},
)  # fmt: skip
tokenize = st.one_of(
    st.fixed_dictionaries({"prompt": prompt}, optional={"add_special_tokens": st.booleans(), "model": model,
                                                        "return_token_strs": st.booleans()}),
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=2)},
                          optional={"add_generation_prompt": st.booleans(), "return_token_strs": st.booleans()}),
)  # fmt: skip
detokenize = st.fixed_dictionaries({"tokens": st.one_of(token_ids, any_json)}, optional={"model": model})
embedding = st.fixed_dictionaries({"input": prompt}, optional={"model": model, "dimensions": ints})

# Issue 36's endpoints: OpenAI's Responses API, Anthropic's Messages API, score and rerank
# (the served model generates text, so score and rerank check their bodies, then refuse).
item = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer"]), texts),
                           "content": st.one_of(content, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": texts}), max_size=2))}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "x"]),
                           "call_id": texts, "name": texts, "arguments": texts, "output": st.one_of(texts, any_json)}),
    any_json,
)  # fmt: skip
responses = st.fixed_dictionaries(
    {"input": st.one_of(texts, st.lists(item, max_size=3), any_json)},
    optional={"model": model, "instructions": texts, "max_output_tokens": max_tokens, "temperature": floats,
              "top_p": floats, "tools": any_json, "tool_choice": any_json, "stream": st.booleans(),
              "store": st.booleans(), "previous_response_id": texts, "reasoning": any_json, "text": any_json,
              "bogus_field": any_json},
)  # fmt: skip
block = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"]),
                           "text": texts, "id": texts, "name": texts, "input": any_json, "tool_use_id": texts,
                           "content": st.one_of(texts, any_json)}),
    any_json,
)  # fmt: skip
anthropic_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant"]), texts),
                                           "content": st.one_of(texts, st.lists(block, max_size=3), any_json)})
messages = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(anthropic_message, min_size=1, max_size=3), any_json), "max_tokens": max_tokens},
    optional={"model": st.one_of(st.just(MODEL), model), "system": st.one_of(texts, any_json), "stop_sequences": stop,
              "stream": st.booleans(), "temperature": floats, "top_p": floats, "top_k": ints, "tools": any_json,
              "tool_choice": any_json, "thinking": any_json, "bogus_field": any_json},
)  # fmt: skip
text_or_texts = st.one_of(texts, st.lists(texts, max_size=4), any_json)
score = st.fixed_dictionaries({"text_1": text_or_texts, "text_2": text_or_texts},
                              optional={"model": model, "truncate_prompt_tokens": ints})  # fmt: skip
rerank = st.fixed_dictionaries({"query": st.one_of(texts, any_json), "documents": text_or_texts},
                               optional={"model": model, "top_n": ints, "return_documents": st.booleans()})  # fmt: skip

# Requests valid in every field (so that they run in the engine with all kinds of sampling
# state), each perhaps with one field replaced by an edge or invalid value.
valid_prompt = st.one_of(
    st.sampled_from(["Hello", "The capital of France is", "One, two, three,", "a" * 200]),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    st.lists(st.sampled_from(["Hi", "Paged attention"]), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20), min_size=1, max_size=3),
)
valid_sampling = {
    "n": st.integers(1, 3),
    "temperature": st.one_of(st.just(0.0), st.floats(0.0, 2.0)),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, VOCAB]), st.integers(1, VOCAB)),
    "min_p": st.floats(0.0, 1.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.1, 10.0),
    "seed": st.integers(-(2**63) + 1, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=5),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=5),
    "stream": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "cache_salt": st.text(min_size=1, max_size=8),
    "model": st.just(MODEL),
}
valid_completion = st.fixed_dictionaries(
    {"prompt": valid_prompt, "max_tokens": st.integers(2, 6)},
    optional={**valid_sampling, "logprobs": st.integers(0, 20), "echo": st.booleans(),
              "prompt_logprobs": st.integers(0, 20)},
)  # fmt: skip
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": st.text(max_size=30)}), min_size=1, max_size=3),
     "max_completion_tokens": st.integers(2, 6)},
    optional={**valid_sampling, "logprobs": st.booleans(), "add_generation_prompt": st.booleans()},
)  # fmt: skip
valid_responses = st.fixed_dictionaries(
    {"model": st.just(MODEL), "input": st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}), min_size=1, max_size=2)),
     "max_output_tokens": st.integers(2, 6)},
    optional={"instructions": st.text(max_size=20), "temperature": st.floats(0.0, 2.0), "stream": st.booleans(),
              "store": st.booleans()},
)  # fmt: skip
valid_messages = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(2, 6),
     "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)}),
                          min_size=1, max_size=2)},
    optional={"system": st.text(max_size=20), "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=2),
              "stream": st.booleans(), "temperature": st.floats(0.0, 1.0), "top_k": st.integers(1, VOCAB)},
)  # fmt: skip
edge_value = st.one_of(ints, floats, texts, st.none(), any_json)


@st.composite
def mutated(draw: Any, base: Any) -> dict:
    body = dict(draw(base))
    if draw(st.integers(0, 2)) == 0:  # a third are mutated in one field
        key = draw(st.sampled_from(sorted({*body, *sampling_fields, "logprobs", "echo", "top_logprobs"})))
        body[key] = draw(edge_value)
    if body.get("top_logprobs") is not None and "logprobs" not in body:
        body["logprobs"] = True
    return body


schema_request = st.one_of(
    st.tuples(st.just("/v1/completions"), mutated(valid_completion)),
    st.tuples(st.just("/v1/completions"), mutated(valid_completion)),
    st.tuples(st.just("/v1/chat/completions"), mutated(valid_chat)),
    st.tuples(st.just("/v1/completions"), completion),
    st.tuples(st.just("/v1/completions"), completion),
    st.tuples(st.just("/v1/completions"), completion),
    st.tuples(st.just("/v1/chat/completions"), chat),
    st.tuples(st.just("/v1/chat/completions"), chat),
    st.tuples(st.just("/tokenize"), tokenize),
    st.tuples(st.just("/detokenize"), detokenize),
    st.tuples(st.sampled_from(["/v1/embeddings", "/pooling"]), embedding),
    st.tuples(st.just("/v1/responses"), st.one_of(responses, mutated(valid_responses))),
    st.tuples(st.sampled_from(["/v1/messages", "/v1/messages", "/v1/messages/count_tokens"]),
              st.one_of(messages, mutated(valid_messages))),
    st.tuples(st.sampled_from(["/v1/score", "/score"]), score),
    st.tuples(st.sampled_from(["/v1/rerank", "/rerank", "/v2/rerank"]), rerank),
)

hostile_body = st.one_of(
    st.binary(max_size=64),
    st.just(b"[" * 100_000),
    st.integers(65, 5000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"),
    st.integers(90, 6000).map(lambda digits: b'{"prompt": "hi", "max_tokens": ' + b"9" * digits + b"}"),
    st.sampled_from([b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}',
                     b'{"prompt": "hi"', b"null", b"[]", b'"prompt"', b"{}", b'{"prompt": "\\ud800"}',
                     b'{"\\udfff": 1}', b'{"prompt": "hi", "prompt": [1]}', b"\xff\xfe{", b'{"prompt": "hi"}\x00']),
    st.integers(BODY_LIMIT - 2048, BODY_LIMIT + 2048).map(
        lambda size: b'{"prompt": "' + b"x " * ((size - 16) // 2) + b'"}'),
)  # fmt: skip
content_type = st.sampled_from(["application/json", "application/json", "application/json; charset=utf-8", None,
                                "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b",
                                "application/xml"])  # fmt: skip
hostile_request = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/pooling",
                     "/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/score", "/rerank"]),
    hostile_body,
    content_type,
)  # fmt: skip


# ----------------------------------------------------------------- sending and checking


def encode(body: Any) -> bytes:
    # ensure_ascii writes a lone surrogate as the escape "\\ud800", as a hostile client would.
    return json.dumps(body, ensure_ascii=True).encode()


def check_response(path: str, body: Any, response: httpx.Response, streamed: bytes | None) -> None:
    status = response.status_code
    STATS[f"status {status}"] += 1
    assert status < 500, f"{path} {str(body)[:400]!r} -> {status} {response.text[:400]}"
    anthropic = path.startswith("/v1/messages")
    if status >= 400:
        body = json.loads(streamed if streamed is not None else response.content)
        error = body["error"]
        if anthropic:  # Anthropic's shape
            assert body["type"] == "error" and set(error) == {"type", "message"} and error["message"]
        else:
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        ERRORS[f"{status} {error.get('param') or error.get('code') or error['type']}"] += 1
        return
    if streamed is not None:
        last = streamed.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]  # the last event
        if path == "/v1/responses":
            assert last.startswith((b"event: response.completed", b"event: response.incomplete")), last[:300]
        elif anthropic:
            assert last.startswith(b"event: message_stop"), last[:300]
        else:
            assert streamed.endswith(b"data: [DONE]\n\n"), streamed[-200:]
        assert b'"server_error"' not in streamed and b"event: error" not in streamed, streamed[:400]
        STATS["streams"] += 1
        return
    data = response.json()
    if path == "/v1/completions" and isinstance(body, dict):
        prompts = body["prompt"]
        num_prompts = 1 if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else len(prompts)
        assert len(data["choices"]) == num_prompts * body.get("n", 1)
        STATS["completions ok"] += 1
    elif path == "/v1/chat/completions" and isinstance(body, dict):
        assert len(data["choices"]) == body.get("n", 1)
        STATS["chats ok"] += 1
    elif path == "/v1/responses":
        assert data["object"] == "response" and data["status"] in ("completed", "incomplete")
        STATS["responses ok"] += 1
    elif path == "/v1/messages":
        assert data["type"] == "message" and data["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence")
        STATS["messages ok"] += 1


def send(client: httpx.Client, path: str, body: Any, content_type: str | None = "application/json",
         disconnect: bool = False) -> None:  # fmt: skip
    raw = body if isinstance(body, bytes) else encode(body)
    headers = {"Content-Type": content_type} if content_type is not None else {}
    STATS["requests"] += 1
    started = time.monotonic()
    with client.stream("POST", path, content=raw, headers=headers) as response:
        is_stream = response.headers.get("content-type", "").startswith("text/event-stream")
        if disconnect and is_stream:
            next(response.iter_raw(), None)  # the first chunk, then the client goes away
            STATS["disconnects"] += 1
            return
        data = response.read()
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    check_response(path, body, response, data if is_stream else None)


def run_batch(clients: list[httpx.Client], batch: list[tuple]) -> None:
    pairs = zip(clients[: len(batch)], batch, strict=True)
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        for future in [pool.submit(send, client, *item) for client, item in pairs]:
            future.result()


def fuzz_settings(examples: int) -> Any:
    return settings(max_examples=EXAMPLES or examples, deadline=None, derandomize=False, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)  # fmt: skip


# ----------------------------------------------------------------- the suite


@seed(SEED)
@fuzz_settings(examples=700)
@given(
    batch=st.lists(schema_request, min_size=1, max_size=MAX_BATCH),
    disconnects=st.lists(st.booleans(), min_size=MAX_BATCH, max_size=MAX_BATCH),
)
def test_schema_requests_never_5xx(clients: list[httpx.Client], batch: list, disconnects: list[bool]) -> None:
    run_batch(clients, [(path, body, "application/json", drop and body.get("stream") is True)
                     for (path, body), drop in zip(batch, disconnects)])  # fmt: skip


@seed(SEED + 1)
@fuzz_settings(examples=150)
@given(batch=st.lists(hostile_request, min_size=1, max_size=6))
def test_hostile_bodies_never_5xx(clients: list[httpx.Client], batch: list) -> None:
    run_batch(clients, batch)


@seed(SEED + 2)
@fuzz_settings(examples=100)
@given(batch=st.lists(schema_request, min_size=4, max_size=MAX_BATCH))
def test_valid_streams_with_disconnects(clients: list[httpx.Client], batch: list) -> None:
    """Streams that are valid enough to run, half of them abandoned after the first chunk."""
    sent = []
    for i, (path, body) in enumerate(batch):
        if path in ("/v1/completions", "/v1/chat/completions"):
            body = {k: v for k, v in body.items() if k in ("prompt", "messages", "n", "temperature", "seed")}
            if path == "/v1/completions":
                body["prompt"] = "Hello"
            else:
                body["messages"] = [{"role": "user", "content": "Hello"}]
            body.update(stream=True, max_tokens=8, n=1, temperature=1.0)
        sent.append((path, body, "application/json", i % 2 == 0))
    run_batch(clients, sent)


def metric_values(server: KvloomServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("kvloom:")}  # fmt: skip


def test_nothing_left_behind(server: KvloomServer, clients: list[httpx.Client]) -> None:
    """After the fuzzing: the engine is healthy and idle, every KV block is free, and no
    error went unhandled. (Runs last in this module.)"""
    http = clients[0]
    names = ("kvloom:num_requests_running", "kvloom:num_requests_waiting", "kvloom:kv_cache_usage_perc")
    deadline = time.monotonic() + 60
    while True:
        values = metric_values(server)
        if all(values.get(n) == 0 for n in names) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {n: values.get(n) for n in names} == dict.fromkeys(names, 0.0)
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    log = server.log()
    for marker in ("Unhandled error", "Traceback", "Engine core loop failed", "output handler failed"):
        assert marker not in log, log[log.find(marker) - 2000 : log.find(marker) + 3000]
    print("\nfuzz summary:", dict(sorted(STATS.items())))
    print("most common errors:", ERRORS.most_common(12))
    if EXAMPLES is None:
        assert STATS["requests"] >= MIN_REQUESTS, dict(STATS)
    assert STATS["status 200"] > 0 and STATS["status 400"] > 0
