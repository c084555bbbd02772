"""``kvloom bench serve``: vLLM's metric definitions checked by hand on a scripted stream
(a scripted stand-in for its HTTP client, a fake clock), the prefix-cache counters of kvloom, vLLM and
SGLang, and whole runs against the in-process fake server: independent random prompts
(a fresh seed per run, printed), a shared prefix only when asked, token-id prompts."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvloom.entrypoints.cli import bench_serve
from kvloom.entrypoints.cli.bench_http import Response
from kvloom.entrypoints.cli.bench_serve_metrics import format_report, prefix_cache_delta, summarize
from kvloom.entrypoints.cli.main import main
from kvloom.entrypoints.openai.api_server import build_app
from kvloom.metrics.loggers import PrometheusStatLogger
from kvloom.metrics.scheduler_stats import PrefixCacheStats, SchedulerStats
from tests.helpers.serve_fakes import FakeAsyncLLM, ServerThread


def test_arrival_gaps_are_poisson() -> None:
    rng = random.Random(0)
    gaps = bench_serve.arrival_gaps(20000, rate=4.0, burstiness=1.0, rng=rng)
    mean = sum(gaps) / len(gaps)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    assert var == pytest.approx(0.25**2, rel=0.06)  # exponential: variance = mean^2
    bursty = bench_serve.arrival_gaps(20000, rate=4.0, burstiness=0.5, rng=rng)
    assert sum(bursty) / len(bursty) == pytest.approx(0.25, rel=0.05)
    assert bench_serve.arrival_gaps(3, rate=float("inf"), burstiness=1.0, rng=rng) == [0.0, 0.0, 0.0]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """A stand-in for the benchmark's HTTP client whose streamed POSTs answer ``events``
    (time, SSE payload), the clock set to each event's time as it arrives."""

    def __init__(self, clock: Clock, events: list[tuple[float, dict[str, Any] | str]]) -> None:
        self.clock, self.events = clock, events

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[tuple[Response, AsyncIterator[str]]]:
        async def lines() -> AsyncIterator[str]:
            for at, payload in self.events:
                self.clock.now = at
                yield f"data: {payload if isinstance(payload, str) else json.dumps(payload)}"
                yield ""

        yield Response(200, {"content-type": "text/event-stream"}), lines()


def choice(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def test_metric_math_matches_hand_computed_values_on_a_scripted_stream() -> None:
    """Request A starts at 10.0: tokens at 10.5, 10.7, two at 11.0, the finish event at
    11.1, usage at 11.3 (5 tokens). Request B starts at 10.2: 10.4, 10.6, 12.4 (3 tokens)."""
    clock = Clock()

    async def one(start: float, events: list) -> bench_serve.RequestResult:
        clock.now = start
        return await bench_serve.send_request(Scripted(clock, events), {"prompt": "x"}, clock=clock)  # type: ignore[arg-type]

    a = asyncio.run(one(10.0, [(10.5, choice("a")), (10.7, choice("b")), (11.0, choice("cd")),
                               (11.1, choice("", "length")), (11.3, usage(4, 5)), (11.4, "[DONE]")]))  # fmt: skip
    b = asyncio.run(one(10.2, [(10.4, choice("a")), (10.6, choice("b")), (12.4, choice("c", "length")),
                               (12.5, usage(4, 3)), (12.5, "[DONE]")]))  # fmt: skip
    assert a.ok and b.ok
    assert (a.ttft, a.e2e, a.output_tokens) == pytest.approx((0.5, 1.1, 5))  # usage and [DONE] are not latency
    assert a.itl == pytest.approx([0.2, 0.3, 0.1]) and a.tpot == pytest.approx(0.6 / 4)
    assert (b.ttft, b.e2e, b.tpot) == pytest.approx((0.2, 2.2, 1.0))
    s = summarize([a, b, bench_serve.RequestResult(error="HTTP 500: boom")], duration=2.5)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (8, 8)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == pytest.approx(
        (0.8, 3.2, 6.4))  # fmt: skip
    assert s["ttft_ms"] == pytest.approx({"mean": 350, "median": 350, "p90": 470, "p99": 497})
    assert s["itl_ms"]["mean"] == pytest.approx(520) and s["itl_ms"]["median"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(575) and s["e2e_latency_ms"]["mean"] == pytest.approx(1650)
    # 1-second buckets from 10.0: A's events at 10.5, 10.7 | 11.0, 11.1; B's 10.4, 10.6 | - | 12.4.
    assert s["peak_output_throughput"] == 4.0 and s["peak_concurrent_requests"] == 2
    assert s["tokens_per_event"] == pytest.approx(8 / 7)
    report = format_report(s)
    for line in ("Peak output token throughput (tok/s):", "Median ITL (ms):", "P99 E2EL (ms):",
                 "Output tokens per stream event:"):  # fmt: skip
        assert line in report


def test_chat_stream_times_the_first_token_not_the_role_event() -> None:
    """A chat stream opens with the assistant role and empty content before any token is
    computed: TTFT is the first content's time, and the text is collected."""
    clock = Clock()

    def delta(**fields: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": fields.pop("finish", None)}]}

    async def one() -> bench_serve.RequestResult:
        events = [(0.01, delta(role="assistant", content="")), (0.4, delta(content="Hel")),
                  (0.5, delta(content="lo", finish="length")), (0.6, usage(9, 2)), (0.6, "[DONE]")]  # fmt: skip
        return await bench_serve.send_request(Scripted(clock, events), {"messages": []}, clock=clock,  # type: ignore[arg-type]
                                              path="/v1/chat/completions")

    result = asyncio.run(one())
    assert result.ok and result.text == "Hello"
    assert (result.ttft, result.e2e, *result.itl) == pytest.approx((0.4, 0.5, 0.1))


def test_prefix_cache_hit_rate_from_each_servers_counters() -> None:
    kvloom = ('kvloom:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}\n'
              'kvloom:prefix_cache_queries_total{{engine="1",model_name="m"}} {q}\n'
              'kvloom:prefix_cache_hits_total{{engine="0",model_name="m"}} {h}\n')  # fmt: skip
    delta = prefix_cache_delta(kvloom.format(q=100, h=10), kvloom.format(q=600, h=110))
    assert delta == {"server": "kvloom", "hits": 100.0, "queries": 1000.0, "hit_rate": 0.1}
    vllm = "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{{model_name=\"m\"}} {h}\n" \
           "vllm:prefix_cache_queries_total{{model_name=\"m\"}} {q}\n"  # fmt: skip
    assert prefix_cache_delta(vllm.format(h=0, q=0), vllm.format(h=30, q=120))["hit_rate"] == 0.25
    sglang = ('sglang:prompt_tokens_total{{model_name="m"}} {q}\n'
              'sglang:cached_tokens_total{{model_name="m",cache_source="device"}} {d}\n'
              'sglang:cached_tokens_total{{model_name="m",cache_source="host"}} {h}\n')  # fmt: skip
    delta = prefix_cache_delta(sglang.format(q=50, d=5, h=0), sglang.format(q=250, d=45, h=10))
    assert (delta["server"], delta["hit_rate"]) == ("sglang", 0.25)
    missing = prefix_cache_delta(None, "process_cpu_seconds_total 3.0\n")
    assert missing["hit_rate"] is None and "no prefix-cache counters" in missing["note"]


@pytest.fixture
def server():
    """The fake engine behind the real app; every request records a prefix-cache lookup of
    its prompt with 2 tokens hit into the Prometheus logger /metrics renders."""
    engine = FakeAsyncLLM(step_delay=0.002)
    prom = PrometheusStatLogger(engine.config)
    engine.stat_loggers = [prom]
    add = engine.add_request

    def add_request(request_id: str, prompt: dict, *args: Any, **kwargs: Any):
        queried = len(prompt["prompt_token_ids"])  # the server tokenized it already
        prom.record(SchedulerStats(prefix_cache_stats=PrefixCacheStats(requests=1, queries=queried, hits=2)), None)
        return add(request_id, prompt, *args, **kwargs)

    engine.add_request = add_request  # type: ignore[method-assign]
    with ServerThread(build_app(engine, log_stats=False)) as thread:
        yield engine, thread.url


def _prompts(engine: FakeAsyncLLM) -> list[list[int]]:
    return [r["prompt_ids"] for r in engine.requests.values()]


def test_independent_random_prompts_metrics_and_hit_rate(server, tmp_path: Path, capsys) -> None:
    engine, url = server
    out = tmp_path / "result.json"
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "12", "--input-len", "7", "--output-len", "5",
                 "--max-concurrency", "4", "--seed", "3", "--json", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Seed: 3 (--seed 3 sends the same prompts again)" in printed
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (12, 0)
    # 7 random tokens per text prompt, plus the BOS the server adds (as it does to vLLM's client's).
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (12 * 8, 12 * 5)
    assert result["config"]["model"] == "fake-model" and result["config"]["seed"] == 3
    assert engine.peak_active == 4  # all at once, held to --max-concurrency
    prompts = _prompts(engine)
    # Text prompts of exactly 7 tokens, independent: no two share even their first 3 tokens.
    assert len(prompts) == 12 and all(len(p) == 8 and p[0] == 1 for p in prompts)
    assert len({tuple(p[1:4]) for p in prompts}) == 12
    assert all(r["params"].max_tokens == 5 and r["params"].ignore_eos for r in engine.requests.values())
    assert result["prefix_cache"] == {"server": "kvloom", "hits": 24.0, "queries": 96.0, "hit_rate": 0.25}
    assert "Server prefix-cache hit rate:" in printed and "25.0%" in printed
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert 0 < result[key]["median"] <= result[key]["p99"]
    assert result["tokens_per_event"] == 1.0  # the fake server sends one token per event


def test_fresh_seed_per_run_prefix_and_token_id_prompts(server, capsys) -> None:
    engine, url = server
    base = ["bench", "serve", "--base-url", url, "--num-prompts", "3", "--random-input-len", "6",
            "--random-output-len", "2"]  # fmt: skip
    assert main(base) == 0 and main(base) == 0  # no --seed: each run draws its own
    seeds = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("Seed: ")]
    assert len(seeds) == 2 and seeds[0] != seeds[1]
    assert len({tuple(p) for p in _prompts(engine)}) == 6
    engine.requests.clear()
    assert main([*base, "--prefix-len", "4", "--prompt-format", "token-ids", "--seed", "1"]) == 0
    prompts = _prompts(engine)
    assert all(len(p) == 10 and p[:4] == prompts[0][:4] for p in prompts)
    assert len({tuple(p[4:]) for p in prompts}) == 3


def test_dataset_prompts_and_bad_flags(server, tmp_path: Path, capsys) -> None:
    engine, url = server
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "w5 w6 w7", "output_len": 3}\n{"prompt_token_ids": [9, 8, 7, 6]}\n')
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "6", "--output-len", "2", "--dataset",
                 str(data), "--seed", "2"]) == 0  # fmt: skip
    lengths = {tuple(r["prompt_ids"]): r["params"].max_tokens for r in engine.requests.values()}
    assert set(lengths.items()) <= {((1, 5, 6, 7), 3), ((9, 8, 7, 6), 2)}
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--input-len", "0"])
    assert "--input-len: 0 (allowed: >= 1)" in capsys.readouterr().err
