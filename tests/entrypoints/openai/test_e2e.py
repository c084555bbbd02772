"""End to end: a real `kvloom serve` subprocess with the default model (SmolLM2-135M on
CPU), driven by the official openai client and raw HTTP, with a stat logger plugin
installed from plugins/examples/stat_logger into a private directory.

One server serves the whole module; outputs are kept short because the CPU is small.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.engine_faults import descendant_pids, wait_gone
from tests.helpers.plugin_server import KvloomServer, install_distribution
from tests.helpers.served import engine_core_pid, metric, metrics
from tests.helpers.waiting import wait_for

API_KEY = "e2e-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}  # /tokenize and /detokenize need the key too
MAX_MODEL_LEN = 512
PLUGIN_SOURCE = Path(__file__).resolve().parents[3] / "plugins" / "examples" / "stat_logger"


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the stat logger plugin of the server writes what it receives."""
    return tmp_path_factory.mktemp("records") / "stat_logger_records.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, records: Path) -> Iterator[KvloomServer]:
    work = tmp_path_factory.mktemp("serve")
    site = install_distribution(PLUGIN_SOURCE, work)
    args = ["--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN), "--log-stats-interval", "1"]
    srv = KvloomServer(args, work, [site], KVLOOM_STATS_JSONL=str(records))
    with srv:
        # The engine core process (under the fork server on the CPU, and a resource tracker).
        children = descendant_pids(srv.process.pid)
        yield srv
    # Ctrl-C is a clean, graceful shutdown, which stops the engine core process too.
    assert srv.process.returncode == 0, srv.log()[-5000:]
    assert all(wait_gone(pid) for pid in children)


@pytest.fixture(scope="module")
def client(server: KvloomServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ----------------------------------------------------------------- basics


def test_the_engine_core_runs_in_its_own_process(server: KvloomServer) -> None:
    # Its log lines, prefixed with its pid, are in the server's log; that pid runs under the server.
    assert engine_core_pid(server) != server.process.pid


def test_models_health_version_tokenize(server: KvloomServer, client: openai.OpenAI, model: str) -> None:
    (card,) = client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct" and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=AUTH).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json()["prompt"]
    assert text == "Hello world"


def test_completion_greedy_stream_equals_whole(server: KvloomServer, client: openai.OpenAI, model: str) -> None:
    prompt = "The capital of France is"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text and streamed == whole.choices[0].text
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=AUTH).json()["count"]
    assert whole.usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    if whole.choices[0].finish_reason == "length":
        assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_chat_greedy_stream_equals_whole(server: KvloomServer, client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Name a primary colour."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    n_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=AUTH).json()["count"]
    assert whole.usage.prompt_tokens == n_prompt


def test_n_choices_seeded(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234, n=3,
                  extra_body={"ignore_eos": True})  # fmt: skip
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in first.choices}) > 1  # and the n samples differ
    assert first.usage.completion_tokens == 3 * 8
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=4, n=2, temperature=0)  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    c = client.completions.create(model=model, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert "".join(lp.tokens) == c.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say yes."}],
                                          max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_stop_strings(client: openai.OpenAI, model: str) -> None:
    prompt = "List the days of the week: Monday, Tuesday,"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 2, free
    stop = words[1]
    stopped = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == free[: free.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


# ----------------------------------------------------------------- load


def test_64_concurrent_streaming_clients(server: KvloomServer, client: openai.OpenAI, model: str) -> None:
    prompts = [f"Write the number {i} in words:" for i in range(8)]
    reference = {
        p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
        for p in prompts
    }

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, int]:
        stream = await aclient.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})  # fmt: skip
        text, finish, tokens = "", "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    async def run_all() -> list[tuple[str, str, int]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        async with aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 8]) for i in range(64)))

    results = asyncio.run(run_all())
    for i, (text, finish, tokens) in enumerate(results):
        assert (finish, tokens) == ("length", 8)
        assert text == reference[prompts[i % 8]]


def test_disconnected_clients_are_aborted_and_kv_freed(server: KvloomServer, model: str) -> None:
    body = {"model": model, "prompt": "Tell me a very long story about a dragon.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
        for _ in range(4):
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                received = 0
                for line in response.iter_lines():
                    received += line.startswith("data: {")
                    if received == 3:
                        break  # leave mid-stream: the connection closes
        assert wait_for(lambda: metric(metrics(server), "kvloom:num_requests_running") == 0, timeout=30, interval=0.2)
        assert wait_for(lambda: metric(metrics(server), "kvloom:kv_cache_usage_perc") == 0, timeout=30, interval=0.2)
        assert metric(metrics(server), "kvloom:num_requests_waiting") == 0
        # The server still answers.
        ok = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_metrics_reflect_requests(server: KvloomServer, client: openai.OpenAI, model: str) -> None:
    before = metrics(server)
    usages = [client.completions.create(model=model, prompt=f"Fact {i}:", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True}).usage for i in range(3)]  # fmt: skip

    def settled() -> bool:
        return metric(metrics(server), "kvloom:e2e_request_latency_seconds_count") >= metric(
            before, "kvloom:e2e_request_latency_seconds_count") + 3  # fmt: skip

    assert wait_for(settled, timeout=10, interval=0.2)
    after = metrics(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("kvloom:request_success_total", finished_reason="length") == 3
    assert delta("kvloom:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 15
    assert delta("kvloom:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("kvloom:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert delta("kvloom:request_generation_tokens_sum") == 15
    assert delta("kvloom:time_to_first_token_seconds_count") == 3
    assert delta("kvloom:inter_token_latency_seconds_count") == 3 * 4
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):  # fmt: skip
        assert delta(f"kvloom:{name}_count") == 3
        assert delta(f"kvloom:{name}_sum") >= 0
    assert delta("kvloom:e2e_request_latency_seconds_sum") > 0
    assert delta("kvloom:prefix_cache_queries_total") > 0
    ((_, labels),) = [k for k in after if k[0] == "kvloom:cache_config_info"]
    labels = dict(labels)
    assert labels["model_name"] == model and labels["num_blocks"] not in ("None", "0")
    assert all(ls and dict(ls).get("model_name") == model for (n, ls) in after if n.startswith("kvloom:"))


# ----------------------------------------------------------------- bad input


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "m", "prompt": ', 400, "Malformed JSON"),
    ("wrong type", "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": -5}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 10**7}, 400, "max_tokens"),
    ("temperature < 0", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1},
     400, "temperature"),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "Hi"}, 404, "gpt-17"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("oversized prompt", "/v1/completions", {"prompt": "word " * (MAX_MODEL_LEN + 50)}, 400, "maximum context length"),
]


def test_bad_input_gets_the_right_error_while_others_are_served(server: KvloomServer, model: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def good_stream(http: httpx.AsyncClient) -> str:
        text = ""
        body = {"model": model, "prompt": "The alphabet: A, B, C,", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def bad_requests(http: httpx.AsyncClient) -> None:
        await asyncio.sleep(0.2)
        for name, path, body, status, fragment in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = await http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = await http.post(path, json={"model": model, **body} if "model" not in body else body)
            assert r.status_code == status, (name, r.text)
            error = r.json()["error"]
            assert fragment in error["message"], (name, error)
            assert set(error) == {"message", "type", "param", "code"}
        r = await http.post("/v1/completions", json={"model": model, "prompt": "Hi"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"

    async def run() -> str:
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as http:
            text, _ = await asyncio.gather(good_stream(http), bad_requests(http))
            return text

    text = asyncio.run(run())
    whole = httpx.post(server.url + "/v1/completions", headers=headers, timeout=120,
                       json={"model": model, "prompt": "The alphabet: A, B, C,", "max_tokens": 24, "temperature": 0,
                             "ignore_eos": True}).json()  # fmt: skip
    assert text == whole["choices"][0]["text"]
    assert httpx.get(server.url + "/health").status_code == 200


# ----------------------------------------------------------------- stat logger plugin


def test_stat_logger_plugin_receives_records(
    server: KvloomServer, records: Path, client: openai.OpenAI, model: str
) -> None:
    client.completions.create(model=model, prompt="Plugins are", max_tokens=4, temperature=0)

    def entries() -> list[dict]:
        if not records.exists():
            return []
        return [json.loads(line) for line in records.read_text().splitlines() if line.strip()]

    assert wait_for(lambda: any(e["event"] == "log" for e in entries()), timeout=10, interval=0.2)
    got = entries()
    init = [e for e in got if e["event"] == "init"]
    assert init and init[0]["model"] == model
    recorded = [e for e in got if e["event"] == "record"]
    iterations = [e["iteration"] for e in recorded if e["iteration"] is not None]
    assert sum(it["num_generation_tokens"] for it in iterations) >= 4
    finished = [f["finish_reason"] for it in iterations for f in it["finished_requests"]]
    assert "length" in finished or "stop" in finished
    assert any(e["scheduler"] and e["scheduler"]["num_running_reqs"] > 0 for e in recorded)
