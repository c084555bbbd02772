"""What vLLM users send works against a real ``kvloom serve`` unchanged (issue 18,
acceptance): the official ``openai`` client with every optional field it can send
(explicit nulls included, vLLM's extras through ``extra_body``), the ``curl`` examples of
vLLM's docs as raw HTTP, LangChain's ``ChatOpenAI`` when installed, and the server flags
a vLLM user types (``--max-logprobs``, ``--response-role``, CORS, ``--chat-template``,
``--enable-log-requests``). The tiny random Llama on the CPU serves the module."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvloom.testing.install import KvloomServer
from tests.helpers.model_fixtures import tiny_model_dir

MODEL = "tiny"
ORIGIN = "https://app.example"
#: The tiny model's template, with a marker that shows --chat-template is the one used.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> FROM-FLAG {% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvloomServer]:
    work = tmp_path_factory.mktemp("serve")
    template = work / "template.jinja"
    template.write_text(TEMPLATE)
    args = [str(tiny_model_dir("llama")), "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "16MiB",
            "--served-model-name", MODEL, "--max-logprobs", "3", "--response-role", "assistant",
            "--chat-template", str(template), "--allowed-origins", json.dumps([ORIGIN]), "--enable-log-requests",
            "--disable-log-stats"]  # fmt: skip
    with KvloomServer(args, work) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: KvloomServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completions_with_every_optional_field(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt="Hello", best_of=1, echo=False, frequency_penalty=0.1, logit_bias={"5": -1.0},
        logprobs=2, max_tokens=4, n=1, presence_penalty=0.1, seed=3, stop=["\n\n"], stream=False,
        stream_options=None, suffix=None, temperature=0.7, top_p=0.9, user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True,
                    "stop_token_ids": [], "skip_special_tokens": True, "include_stop_str_in_output": False,
                    "priority": 0},
    )  # fmt: skip
    assert len(result.choices) == 1 and result.usage.completion_tokens == 4
    assert len(result.choices[0].logprobs.tokens) == 4


def test_completions_with_explicit_nulls_and_streaming(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, best_of=None, echo=None,
                                       frequency_penalty=None, logit_bias=None, logprobs=None, n=None,
                                       presence_penalty=None, seed=None, stop=None, stream=None, suffix=None,
                                       temperature=None, top_p=None, user=None)  # fmt: skip
    assert result.choices[0].logprobs is None and result.usage.completion_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True, temperature=0,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 3


def test_chat_with_every_optional_field(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        frequency_penalty=0.0, logit_bias={"7": 1.0}, logprobs=True, top_logprobs=2, max_completion_tokens=4,
        max_tokens=None, metadata={"k": "v"}, n=2, parallel_tool_calls=None, presence_penalty=0.0,
        reasoning_effort=None, response_format={"type": "text"}, seed=1, service_tier="auto", stop="\n\n",
        store=False, stream=False, temperature=0.5, tool_choice="none", top_p=1.0, user="u1", modalities=["text"],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "top_k": 10, "min_p": 0.0,
                    "repetition_penalty": 1.0, "add_generation_prompt": True, "skip_special_tokens": True},
    )  # fmt: skip
    assert len(result.choices) == 2 and result.choices[0].message.role == "assistant"
    assert sum(len(c.logprobs.content) for c in result.choices) == result.usage.completion_tokens


def test_chat_with_explicit_nulls_and_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=None,
                                            top_logprobs=None, n=None, stream=None, temperature=None, top_p=None,
                                            stop=None, seed=None, tools=None, tool_choice=None,
                                            response_format=None)  # fmt: skip
    assert result.choices[0].logprobs is None and result.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 3


def test_the_chat_template_flag_is_used(server: KvloomServer) -> None:
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert "FROM-FLAG" in text


def test_features_not_built_are_a_clear_400(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    # Tools work (docs/structured_outputs.md); "auto", their default, needs the server's
    # --enable-auto-tool-choice and --tool-call-parser, which this server was not given.
    with pytest.raises(openai.BadRequestError, match="tool_choice.*--enable-auto-tool-choice and --tool-call-parser"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=[tool])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="'image_url' are not supported by kvloom yet"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="Hi", best_of=2)


def test_max_logprobs_limits_requests(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"logprobs: 4 is more than this engine allows.*--max-logprobs"):
        client.completions.create(model=MODEL, prompt="Hi", logprobs=4, max_tokens=1)


# ----------------------------------------------------------------- vLLM docs' curl examples


def test_curl_examples_of_the_vllm_docs(server: KvloomServer) -> None:
    headers = {"Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60, content=json.dumps(
        {"model": MODEL, "prompt": "San Francisco is a", "max_tokens": 7, "temperature": 0}))  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60, content=json.dumps(
        {"model": MODEL, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                      {"role": "user", "content": "Who won the world series in 2020?"}],
         "max_tokens": 5}))  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=headers, timeout=60, content=json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "stream": True,
             "max_tokens": 4})) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_cors_preflight_answers_the_allowed_origin(server: KvloomServer) -> None:
    r = httpx.options(server.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(server.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_requests_are_logged(server: KvloomServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    assert "Received request cmpl-" in server.log()
    assert "were present in the request but ignored" in server.log()  # the chat test's store, metadata, ...


def test_langchain_chat_openai(server: KvloomServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, max_tokens=4,
                                       temperature=0, max_retries=0, timeout=60)  # fmt: skip
    reply = chat.invoke("Hello")
    assert isinstance(reply.content, str) and reply.response_metadata["finish_reason"] in ("length", "stop")
    chunks = list(chat.stream("Hello"))
    assert chunks
