"""The OpenAI-compatible server against a deterministic fake engine: protocol shapes,
streaming format, n > 1, logprobs, usage, parameters reaching the engine, errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from kvloom.entrypoints.openai.api_server import build_app
from kvloom.metrics.loggers import PrometheusStatLogger
from kvloom.metrics.scheduler_stats import SchedulerStats
from kvloom.metrics.stats import IterationStats
from kvloom.sampling_params import RequestOutputKind
from tests.helpers.serve_fakes import (
    FakeAsyncLLM,
    WordTokenizer,
    expected_text,
    expected_tokens,
    fake_logprob,
    make_config,
)

TOK = WordTokenizer()


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture
def client(engine: FakeAsyncLLM) -> TestClient:
    return TestClient(build_app(engine, log_stats=False))


def sse_events(text: str) -> list[Any]:
    """The data payloads of an SSE body; asserts the framing and the final [DONE]."""
    assert text.endswith("data: [DONE]\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def post(client: TestClient, path: str, body: Any, headers: dict | None = None):
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})


def assert_error(response, status: int, *fragments: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in body["error"]["message"], body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


# ----------------------------------------------------------------- completions


def test_completion_whole(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/completions", {"model": "fake-model", "prompt": "w5 w6 w7", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = [1, 5, 6, 7]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["text"] == expected_text(TOK, expected_tokens(prompt_ids, 5))
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    (req,) = engine.requests.values()
    assert req["prompt_ids"] == prompt_ids
    assert req["params"].output_kind == RequestOutputKind.FINAL_ONLY
    assert req["params"].max_tokens == 5 and req["params"].temperature == 0


def test_completion_stream_equals_whole_and_usage_chunk(client: TestClient, engine: FakeAsyncLLM) -> None:
    body = {"prompt": "w5 w6", "max_tokens": 6, "temperature": 0}
    whole = post(client, "/v1/completions", body).json()["choices"][0]["text"]
    r = post(client, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    *chunks, usage = events
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len(chunks) == 6  # one per token
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert len({c["id"] for c in events}) == 1
    stream_params = [r["params"] for r in engine.requests.values()][-1]
    assert stream_params.output_kind == RequestOutputKind.DELTA


def test_completion_stream_without_usage(client: TestClient) -> None:
    r = post(client, "/v1/completions", {"prompt": "w5", "max_tokens": 2, "stream": True})
    events = sse_events(r.text)
    assert all(e["choices"] for e in events)


def test_completion_n_and_batch_indices(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/completions", {"prompt": ["w5 w6", "w7"], "n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 10})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    # One engine request per prompt, n inside; the engine runs child i with seed + i.
    assert [(req["prompt_ids"], req["params"].n, req["params"].seed) for req in engine.requests.values()] == [
        ([1, 5, 6], 3, 10), ([1, 7], 3, 10)]  # fmt: skip
    children = sorted(engine.core_requests.values(), key=lambda c: (c["parent"], c["index"]))
    assert [c["params"].seed for c in children] == [10, 11, 12, 10, 11, 12]
    for c in body["choices"]:
        prompt_ids = [1, 5, 6] if c["index"] < 3 else [1, 7]
        seed = 10 + c["index"] % 3
        assert c["text"] == expected_text(TOK, expected_tokens(prompt_ids, 4, seed, 1.0))
    texts = [c["text"] for c in body["choices"][:3]]
    assert len(set(texts)) == 3  # different seeds, different samples
    assert body["usage"]["prompt_tokens"] == 3 + 2  # each prompt once
    assert body["usage"]["completion_tokens"] == 6 * 4


def test_completion_n_stream_interleaves_all_choices(client: TestClient) -> None:
    r = post(client, "/v1/completions", {"prompt": "w5", "n": 2, "max_tokens": 3, "stream": True,
                                         "stream_options": {"include_usage": True}})  # fmt: skip
    *chunks, usage = sse_events(r.text)
    by_index: dict[int, list[str]] = {0: [], 1: []}
    finishes = {}
    for c in chunks:
        (choice,) = c["choices"]
        by_index[choice["index"]].append(choice["text"])
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    assert all(len(v) == 3 for v in by_index.values())
    assert usage["usage"]["completion_tokens"] == 6 and usage["usage"]["prompt_tokens"] == 2


def test_completion_token_id_prompts(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/completions", {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2, "temperature": 0})
    body = r.json()
    assert body["choices"][0]["text"] == expected_text(TOK, expected_tokens([5, 6], 2))
    assert body["choices"][1]["text"] == expected_text(TOK, expected_tokens([7, 8, 9], 2))
    r = post(client, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "temperature": 0})
    assert r.json()["choices"][0]["text"] == body["choices"][0]["text"]


def test_completion_logprobs(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/completions", {"prompt": "w5", "max_tokens": 3, "temperature": 0, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    ids = expected_tokens([1, 5], 3)
    assert lp["tokens"] == [TOK.WORDS[t] for t in ids]
    assert lp["token_logprobs"] == [fake_logprob(t, 3) for t in ids]
    # The fake's text puts a space between words; tokens are the bare words.
    text = r.json()["choices"][0]["text"]
    assert text == " ".join(lp["tokens"])
    assert lp["text_offset"] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert tok in top and len(top) == 3  # sampled (rank 3) + top-2
    assert engine.requests[next(iter(engine.requests))]["params"].logprobs == 2


def test_completion_logprobs_stream_matches_whole(client: TestClient) -> None:
    body = {"prompt": "w5 w8", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    whole = post(client, "/v1/completions", body).json()["choices"][0]["logprobs"]
    events = sse_events(post(client, "/v1/completions", {**body, "stream": True}).text)
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        for k in merged:
            merged[k] += e["choices"][0]["logprobs"][k]
    assert merged == whole


def test_completion_echo(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 2, "temperature": 0, "echo": True})
    text = r.json()["choices"][0]["text"]
    assert text == "w5 w6" + expected_text(TOK, expected_tokens([1, 5, 6], 2))
    r = post(client, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][:3] == ["<s>", "w5", "w6"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1] == fake_logprob(5, 1)
    assert len(lp["tokens"]) == 5
    params = list(engine.requests.values())[-1]["params"]
    assert params.prompt_logprobs == 1


def test_stop_strings_and_eos(client: TestClient, engine: FakeAsyncLLM) -> None:
    ids = expected_tokens([1, 5], 6)
    stop_word = TOK.WORDS[ids[3]]
    r = post(client, "/v1/completions", {"prompt": "w5", "max_tokens": 6, "temperature": 0, "stop": stop_word})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_word
    assert stop_word not in choice["text"]
    assert list(engine.requests.values())[-1]["params"].stop == [stop_word]
    # Prompts ending in w9 produce EOS after 3 tokens in the fake.
    r = post(client, "/v1/completions", {"prompt": "w9", "max_tokens": 10, "temperature": 0})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 4
    r = post(client, "/v1/completions", {"prompt": "w9", "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_sampling_fields_reach_the_engine() -> None:
    engine = FakeAsyncLLM(make_config(policy="priority", lora_modules={"ad1": "/a/1", "ad2": "/a/2"}))
    client = TestClient(build_app(engine, log_stats=False))
    r = post(client, "/v1/completions", {
        "model": "ad2", "prompt": "w5", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
        "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "seed": 3, "stop": ["x", "y"], "stop_token_ids": [4], "ignore_eos": True, "min_tokens": 2,
        "cache_salt": "salty", "priority": -3, "skip_special_tokens": False, "include_stop_str_in_output": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "ad2"
    (req,) = engine.requests.values()
    p = req["params"]
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 7, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens) == (3, ["x", "y"], [4], True, 2)
    assert p.skip_special_tokens is False and p.include_stop_str_in_output is True
    assert p.n == 1 and p.max_tokens == 4
    assert req["cache_salt"] == "salty" and req["priority"] == -3
    assert req["lora"].lora_name == "ad2" and req["lora"].lora_int_id == 2 and req["lora"].lora_path == "/a/2"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model", "ad1", "ad2"]
    assert models["data"][2]["parent"] == "fake-model" and models["data"][0]["max_model_len"] == 64


def test_max_tokens_default_fills_the_context(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/completions", {"prompt": "w5 w6", "max_tokens": None, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 64 - 3
    r = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 64 - 3  # <|user|> w5 <|assistant|>


# ----------------------------------------------------------------- chat


def chat_body(**kw: Any) -> dict:
    return {"model": "fake-model", "messages": [{"role": "system", "content": "w10"}, {"role": "user", "content": "w5 w6"}], **kw}


CHAT_PROMPT = [4, 10, 2, 5, 6, 3]  # <|system|> w10 <|user|> w5 w6 <|assistant|>


def test_chat_whole(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/chat/completions", chat_body(max_completion_tokens=4, temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected_text(TOK, expected_tokens(CHAT_PROMPT, 4))}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    (req,) = engine.requests.values()
    assert req["prompt_ids"] == CHAT_PROMPT  # template rendered, no extra BOS


def test_chat_max_completion_tokens_wins_over_max_tokens(client: TestClient, engine: FakeAsyncLLM) -> None:
    post(client, "/v1/chat/completions", chat_body(max_tokens=9, max_completion_tokens=3))
    post(client, "/v1/chat/completions", chat_body(max_tokens=5))
    assert [r["params"].max_tokens for r in engine.requests.values()] == [3, 5]


def test_chat_stream(client: TestClient) -> None:
    whole = post(client, "/v1/chat/completions", chat_body(max_completion_tokens=5, temperature=0)).json()
    r = post(client, "/v1/chat/completions", chat_body(max_completion_tokens=5, temperature=0, stream=True, n=2,
                                                       stream_options={"include_usage": True}))  # fmt: skip
    *chunks, usage = sse_events(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[2:]:
        (choice,) = c["choices"]
        assert set(choice["delta"]) <= {"content"}
        text[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert text[0] == text[1] == whole["choices"][0]["message"]["content"]
    assert finish == {0: "length", 1: "length"}
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 6, "completion_tokens": 10, "total_tokens": 16}


def test_chat_logprobs(client: TestClient, engine: FakeAsyncLLM) -> None:
    r = post(client, "/v1/chat/completions", chat_body(max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=2))
    content = r.json()["choices"][0]["logprobs"]["content"]
    ids = expected_tokens(CHAT_PROMPT, 3)
    assert [c["token"] for c in content] == [TOK.WORDS[t] for t in ids]
    for c, t in zip(content, ids):
        assert c["logprob"] == fake_logprob(t, 3)
        assert c["bytes"] == list(c["token"].encode())
        assert [x["logprob"] for x in c["top_logprobs"]] == sorted((x["logprob"] for x in c["top_logprobs"]), reverse=True)
        assert len(c["top_logprobs"]) == 2
    assert list(engine.requests.values())[-1]["params"].logprobs == 2
    r = post(client, "/v1/chat/completions", chat_body(max_completion_tokens=2, logprobs=True))
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(c["top_logprobs"] == [] for c in content)
    streamed = sse_events(post(client, "/v1/chat/completions", chat_body(
        max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=2, stream=True)).text)  # fmt: skip
    tokens = [c["token"] for e in streamed if e["choices"][0].get("logprobs") for c in e["choices"][0]["logprobs"]["content"]]
    assert tokens == [TOK.WORDS[t] for t in ids]


def test_chat_content_parts(client: TestClient, engine: FakeAsyncLLM) -> None:
    body = chat_body(max_completion_tokens=1)
    body["messages"][1]["content"] = [{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6"}]
    assert post(client, "/v1/chat/completions", body).status_code == 200
    assert list(engine.requests.values())[-1]["prompt_ids"] == CHAT_PROMPT


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "path,body,fragments,param",
    [
        ("/v1/completions", {"prompt": "w5", "max_tokens": "ten"}, ["max_tokens: Input should be a valid integer"], "max_tokens"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": -1},
         ["max_tokens: Input should be greater than or equal to 1", "allowed range: 1 <= max_tokens"], "max_tokens"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": 10**9},
         ["max_tokens: 1000000000 is too large", "allowed range: 1 <= max_tokens <= 62"], "max_tokens"),
        ("/v1/completions", {"prompt": "w5", "temperature": -0.5},
         ["temperature: Input should be greater than or equal to 0", "allowed range: 0.0 <= temperature <= 100.0"], "temperature"),
        ("/v1/completions", {"prompt": "w5", "temperature": "hot"}, ["temperature: Input should be a valid number"], "temperature"),
        ("/v1/completions", {"prompt": "w5", "top_p": 0}, ["top_p", "allowed range: 0.0 < top_p <= 1.0"], "top_p"),
        ("/v1/completions", {"prompt": "w5", "logprobs": 21}, ["logprobs", "allowed range: 0 <= logprobs <= 20"], "logprobs"),
        ("/v1/completions", {"prompt": "w5", "n": 0}, ["n: Input should be greater than or equal to 1"], "n"),
        ("/v1/completions", {"prompt": 5}, ["prompt: must be a string"], "prompt"),
        ("/v1/completions", {"max_tokens": 3}, ["prompt: field required"], "prompt"),
        ("/v1/completions", {"prompt": "w5", "stream": "yes"}, ["stream: Input should be a valid boolean"], "stream"),
        ("/v1/completions", {"prompt": "w5", "stream_options": {"include_usage": True}},
         ["stream_options: only allowed when stream is true"], "stream_options"),
        ("/v1/completions", {"prompt": "w5", "stop": ["a", 3]}, ["stop: must be a string or a list of strings"], "stop"),
        ("/v1/completions", {"prompt": "w5", "best_of": 3}, ["best_of: only best_of == n"], "best_of"),
        ("/v1/completions", {"prompt": "w5", "logit_bias": {"abc": 1.0}}, ["logit_bias: key 'abc' is not a token id"], "logit_bias"),
        ("/v1/completions", {"prompt": "w5", "logit_bias": {"5": 101}}, ["logit_bias: the bias of token 5 must be a number in [-100, 100]"], "logit_bias"),
        ("/v1/completions", {"prompt": "w5", "logit_bias": {"200": 1}}, ["logit_bias: token id 200 is out of range (allowed: 0..199)"], "logit_bias"),
        ("/v1/completions", {"prompt": "w5", "top_k": 1180591620717411303424},
         ["top_k: 1180591620717411303424 is out of range (allowed: -1 or 0 to disable top-k, else 1 <= top_k <= 200"], "top_k"),
        ("/v1/completions", {"prompt": "w5", "top_k": -2}, ["top_k: Input should be greater than or equal to -1"], "top_k"),
        ("/v1/completions", {"prompt": "w5", "stop_token_ids": [5, 200]}, ["stop_token_ids: token id 200 is out of range (allowed: 0..199)"], "stop_token_ids"),
        ("/v1/completions", {"prompt": "w5", "stop_token_ids": [-3]}, ["stop_token_ids[0]: Input should be greater than or equal to 0"], "stop_token_ids[0]"),
        ("/v1/completions", {"prompt": "w5", "stop": ["x"] * 65}, ["stop: 65 stop strings are too many (allowed: at most 64)"], "stop"),
        ("/v1/completions", {"prompt": "w5", "stop": "x" * 1025}, ["stop: a stop string has 1025 characters (allowed: 1..1024)"], "stop"),
        ("/v1/completions", {"prompt": "w5", "seed": 2**63}, ["seed: Input should be less than or equal to 9223372036854775807"], "seed"),
        ("/v1/completions", {"prompt": "w5", "best_of": 129, "n": 129}, ["n: Input should be less than or equal to 128"], "n"),
        ("/v1/completions", {"prompt": ["w5"] * 3, "n": 100}, ["prompt: 3 prompt(s) x n=100 make 300 sequences", "prompts x n <= 256"], "prompt"),
        ("/v1/completions", {"prompt": [[5, 199], [5, 200]]}, ["prompt: token id 200 is out of range (allowed: 0..199)"], "prompt"),
        ("/v1/completions", {"prompt": "w5", "priority": 1}, ["priority: 1 needs", "--scheduling-policy priority"], "priority"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": 2, "min_tokens": 5}, ["min_tokens (5) must be less than or equal to max_tokens (2)"], None),
        ("/v1/completions", {"prompt": " ".join(["w5"] * 70)},
         ["prompt: the prompt is 71 tokens, but this model's maximum context length is 64"], "prompt"),
        ("/v1/completions", {"prompt": [[5], [-1]]}, ["prompt: token id -1 is out of range (allowed: 0..199)"], "prompt"),
        ("/v1/chat/completions", {"model": "fake-model"}, ["messages: field required"], "messages"),
        ("/v1/chat/completions", {"messages": []}, ["messages: List should have at least 1 item"], "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w5"}]}, ["messages[0].role: Input should be"], "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         ["messages[0].content", "text parts"], "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "w5"}]}, ["messages: the chat template rejected them"], "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2},
         ["top_logprobs: requires logprobs to be true"], "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 62},
         ["max_completion_tokens: 62 is too large", "<= 61"], "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "tools": [{"type": "function"}]},
         ["tools[0].function: field required"], "tools[0].function"),
    ],
)
def test_bad_fields_are_400(client: TestClient, path: str, body: dict, fragments: list[str], param: str | None) -> None:
    assert_error(post(client, path, body), 400, *fragments, param=param)


def test_empty_prompt_is_400(client: TestClient, engine: FakeAsyncLLM) -> None:
    engine.tokenizer.encode = lambda text, add_special_tokens=True: []  # type: ignore[method-assign]
    assert_error(post(client, "/v1/completions", {"prompt": ""}), 400, "prompt: the prompt is empty", param="prompt")


def test_malformed_json_and_non_object_bodies(client: TestClient) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = client.post(path, content=b'{"prompt": "w5", ', headers={"Content-Type": "application/json"})
        err = assert_error(r, 400, "Malformed JSON body")
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert_error(client.post("/v1/completions", content=b""), 400, "Request body is empty")
    assert_error(post(client, "/v1/completions", ["w5"]), 400, "must be a JSON object, got list")


def test_unknown_model_is_404(client: TestClient) -> None:
    err = assert_error(post(client, "/v1/completions", {"model": "gpt-9", "prompt": "w5"}), 404,
                       "The model `gpt-9` does not exist", param="model")  # fmt: skip
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error"
    assert_error(post(client, "/v1/chat/completions", chat_body(model="nope")), 404, "`nope`")


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, "Not Found")
    assert_error(client.get("/v1/completions"), 405, "Method Not Allowed")


class TypedBody(BaseModel):
    x: int


def test_fastapi_validation_errors_become_400(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, log_stats=False)

    @app.post("/typed")
    async def typed(body: TypedBody) -> dict:
        return {"x": body.x}

    client = TestClient(app)
    assert_error(post(client, "/typed", {"x": "nope"}), 400, "x: Input should be a valid integer", param="x")
    assert_error(client.post("/typed", content=b"{", headers={"Content-Type": "application/json"}), 400, "Malformed JSON body")


def test_engine_value_error_is_400_and_other_errors_500(engine: FakeAsyncLLM, caplog: pytest.LogCaptureFixture) -> None:
    """The engine refuses a request when it is added (a ValueError): a 400 with the reason,
    for a stream too (before any byte). The engine fails while running it: a 500 (or, once
    streaming, an error event) saying "internal error" with the request id; the detail is
    only in the log."""
    client = TestClient(build_app(engine, log_stats=False), raise_server_exceptions=False)

    def bad_input(*args: Any, **kwargs: Any):
        raise ValueError("prompt is 5000 tokens, longer than max_model_len 4096")

    async def boom(*args: Any, **kwargs: Any):
        raise RuntimeError("GPU on fire")
        yield  # pragma: no cover

    engine.add_request = bad_input  # type: ignore[method-assign]
    assert_error(post(client, "/v1/completions", {"prompt": "w5"}), 400, "prompt is 5000 tokens")
    assert_error(post(client, "/v1/completions", {"prompt": "w5", "stream": True}), 400, "prompt is 5000 tokens")
    engine.add_request = boom  # type: ignore[method-assign]
    err = assert_error(post(client, "/v1/chat/completions", chat_body()), 500, "Internal server error (request id: chatcmpl-")
    assert err["type"] == "server_error" and "GPU" not in err["message"]
    events = sse_events(post(client, "/v1/chat/completions", chat_body(stream=True)).text)
    assert events[-1]["error"]["message"].startswith("Internal server error (request id: chatcmpl-")
    assert "GPU" not in json.dumps(events)
    assert "GPU on fire" in caplog.text


def test_server_keeps_serving_after_errors(client: TestClient) -> None:
    for body in ({"prompt": 1}, {"prompt": "w5", "max_tokens": -4}, {"model": "x", "prompt": "w5"}):
        assert post(client, "/v1/completions", body).status_code in (400, 404)
    assert post(client, "/v1/completions", {"prompt": "w5", "max_tokens": 1}).status_code == 200


# ----------------------------------------------------------------- API key


def test_api_key(engine: FakeAsyncLLM) -> None:
    client = TestClient(build_app(engine, api_key="sekrit", log_stats=False))
    body = {"prompt": "w5", "max_tokens": 1}
    err = assert_error(post(client, "/v1/completions", body), 401, "API key")
    assert err["type"] == "authentication_error"
    assert_error(post(client, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.get("/v1/models", headers={"Authorization": "Basic sekrit"}), 401)
    ok = client.post("/v1/completions", content=json.dumps(body), headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    # Operational endpoints stay open (as in vLLM, only /v1 is protected).
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


# ----------------------------------------------------------------- other endpoints


def test_health_version(client: TestClient, engine: FakeAsyncLLM) -> None:
    import kvloom

    assert client.get("/health").status_code == 200
    assert client.get("/version").json() == {"version": kvloom.__version__}
    engine.healthy = False
    assert_error(client.get("/health"), 503, "engine is dead")


def test_tokenize_detokenize(client: TestClient) -> None:
    r = post(client, "/tokenize", {"prompt": "w5 w6", "return_token_strs": True}).json()
    assert r == {"count": 3, "max_model_len": 64, "tokens": [1, 5, 6], "token_strs": ["<s>", "w5", "w6"]}
    r = post(client, "/tokenize", {"prompt": "w5 w6", "add_special_tokens": False}).json()
    assert r["tokens"] == [5, 6] and r["token_strs"] is None
    r = post(client, "/tokenize", {"messages": [{"role": "user", "content": "w5"}]}).json()
    assert r["tokens"] == [2, 5, 3]
    assert post(client, "/detokenize", {"tokens": [5, 6]}).json() == {"prompt": "w5 w6"}
    assert_error(post(client, "/detokenize", {"tokens": [5, 1000]}), 400, "tokens: token id 1000 is out of range (allowed: 0..199)")
    assert_error(post(client, "/detokenize", {"tokens": [-1]}), 400, "tokens: token id -1 is out of range")
    assert_error(post(client, "/tokenize", {"prompt": "w5", "model": "zzz"}), 404)
    assert_error(post(client, "/tokenize", {"text": "w5"}), 400, "prompt: field required")


def test_metrics_endpoint_renders_prometheus_logger() -> None:
    engine = FakeAsyncLLM(make_config(served_model_name="mm"))
    prom = PrometheusStatLogger(engine.config)
    engine.stat_loggers = [prom]
    prom.record(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5), IterationStats(num_generation_tokens=7))
    client = TestClient(build_app(engine, log_stats=False))
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'kvloom:num_requests_running{engine="0",model_name="mm"} 2.0' in r.text
    assert 'kvloom:kv_cache_usage_perc{engine="0",model_name="mm"} 0.5' in r.text
    assert 'kvloom:generation_tokens_total{model_name="mm"} 7.0' in r.text
    assert "process_cpu_seconds_total" in r.text or "python_info" in r.text


def test_without_tokenizer_token_ids_only() -> None:
    engine = FakeAsyncLLM(tokenizer=None)
    client = TestClient(build_app(engine, log_stats=False))
    assert_error(post(client, "/v1/completions", {"prompt": "w5"}), 400, "without a tokenizer", param="prompt")
    assert_error(post(client, "/v1/chat/completions", chat_body()), 400, "without a tokenizer", param="messages")
    r = post(client, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 1, "temperature": 0})
    assert r.status_code == 200
    ids = expected_tokens([5, 6], 2)
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
