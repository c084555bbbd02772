"""`kvloom serve` argument handling and `kvloom bench serve` against a fake-engine server."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvloom.engine.arg_utils import EngineArgs
from kvloom.entrypoints.cli import bench_serve
from kvloom.entrypoints.cli.main import build_parser, main
from kvloom.entrypoints.openai.api_server import build_app
from tests.helpers.serve_fakes import FakeAsyncLLM, ServerThread


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    async def fake_serve_http(engine_args: EngineArgs, **kwargs: Any) -> None:
        calls.append({"engine_args": engine_args, **kwargs})

    import kvloom.entrypoints.openai.api_server as api_server

    monkeypatch.setattr(api_server, "serve_http", fake_serve_http)
    return calls


def test_serve_flags(served: list) -> None:
    assert main(["serve", "/models/m", "--port", "8123", "--host", "127.0.0.1", "--api-key", "k",
                 "--served-model-name", "mine", "--max-model-len", "256", "--no-enable-prefix-caching",
                 "-O0", "--disable-uvicorn-access-log"]) == 0  # fmt: skip
    (call,) = served
    args = call["engine_args"]
    assert args.model == "/models/m" and args.served_model_name == ["mine"] and args.max_model_len == 256
    assert args.enable_prefix_caching is False and args.optimization_level == 0
    assert call["host"] == "127.0.0.1" and call["port"] == 8123 and call["api_key"] == "k"
    assert call["access_log"] is False


def test_serve_defaults_and_env_api_key(served: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_API_KEY", "from-env")
    assert main(["serve"]) == 0
    (call,) = served
    assert call["engine_args"] == EngineArgs()
    assert (call["host"], call["port"], call["api_key"]) == ("0.0.0.0", 8000, "from-env")


def test_serve_request_limit_flags(served: list) -> None:
    from kvloom.entrypoints.openai.limits import ServerLimits

    main(["serve"])
    main(["serve", "--max-request-body-bytes", "65536", "--max-sequences-per-request", "16", "--max-json-depth", "8",
          "--max-json-number-length", "30"])  # fmt: skip
    assert served[0]["limits"] == ServerLimits()
    assert served[1]["limits"] == ServerLimits(max_request_body_bytes=65536, max_sequences_per_request=16,
                                               max_json_depth=8, max_json_number_length=30)  # fmt: skip


def test_serve_api_server_count_starts_the_launcher(
    served: list, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import kvloom.entrypoints.openai.launcher as launcher

    launched: list[tuple] = []
    monkeypatch.setattr(launcher, "launch", lambda *args: launched.append(args) or 0)
    assert main(["serve", "/m", "--api-server-count", "3", "--port", "8123", "--api-key", "k"]) == 0
    ((engine_args, options, count),) = launched
    assert engine_args.model == "/m" and count == 3 and served == []
    assert (options.port, options.api_key, options.access_log) == (8123, "k", True)
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(SystemExit):
        main(["serve", "/m", "--api-server-count", "2"])
    assert "--api-server-count 2: the API servers share engine cores in processes" in capsys.readouterr().err
    assert len(launched) == 1


def test_serve_model_flag_and_positional(served: list) -> None:
    main(["serve", "--model", "/m"])
    main(["serve", "/m", "--model", "/m"])
    assert [c["engine_args"].model for c in served] == ["/m", "/m"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "/a", "--model", "/b"], "disagree"),
        (["serve", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization: Input should be less than or equal to 1"),
        (["serve", "--port", "70000"], "--port: 70000 is out of range"),
        (["serve", "--api-server-count", "0"], "--api-server-count: 0 is out of range (allowed: 1..64)"),
        (["serve", "--dtype", "int3"], "invalid choice"),
        (["serve", "--max-sequences-per-request", "0"], "--max-sequences-per-request: must be at least 1"),
        (["serve", "--max-request-body-bytes", "10"], "--max-request-body-bytes: must be at least 1024"),
    ],
)
def test_serve_bad_flags_exit_2(served: list, capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert served == []


def test_help_lists_engine_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-num-seqs", "--enable-prefix-caching",
                 "--max-request-body-bytes", "--max-sequences-per-request", "--max-json-depth"):  # fmt: skip
        assert flag in out


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


def test_summarize_statistics() -> None:
    results = [
        bench_serve.RequestResult(ok=True, prompt_tokens=4, output_tokens=3, ttft=0.1, e2e=0.5, itl=[0.2, 0.2]),
        bench_serve.RequestResult(ok=True, prompt_tokens=4, output_tokens=5, ttft=0.3, e2e=1.1, itl=[0.2] * 4),
        bench_serve.RequestResult(ok=False, error="HTTP 500: boom"),
    ]
    s = bench_serve.summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert s["total_input_tokens"] == 8 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0 and s["total_token_throughput"] == 8.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(200.0)
    assert s["e2e_latency_ms"]["p99"] == pytest.approx(500 + 0.99 * 600)
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)
    assert "Successful requests:" in bench_serve.format_report(s)


def test_bench_serve_against_a_server(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    engine = FakeAsyncLLM(step_delay=0.002)
    out = tmp_path / "result.json"
    with ServerThread(build_app(engine, api_key="k", log_stats=False)) as server:
        code = main(["bench", "serve", "--base-url", server.url, "--api-key", "k", "--num-prompts", "12",
                     "--input-len", "7", "--output-len", "5", "--request-rate", "inf", "--max-concurrency", "4",
                     "--json", str(out)])  # fmt: skip
    assert code == 0
    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report and "Mean TTFT (ms):" in report
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_input_tokens"] == 12 * 7 and result["total_output_tokens"] == 12 * 5
    assert result["config"]["model"] == "fake-model" and result["config"]["max_concurrency"] == 4
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert 0 < result[key]["p50"] <= result[key]["p99"]
    assert result["e2e_latency_ms"]["mean"] > result["ttft_ms"]["mean"]
    assert engine.peak_active == 4  # all arrive at once; --max-concurrency holds them to 4
    # Every request asked for exactly input_len prompt tokens and output_len tokens.
    assert all(len(r["prompt_ids"]) == 7 and r["params"].max_tokens == 5 and r["params"].ignore_eos
               for r in engine.requests.values())  # fmt: skip
