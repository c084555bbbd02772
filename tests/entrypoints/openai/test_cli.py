"""`kvloom serve` argument handling (`kvloom bench serve`: tests/entrypoints/cli/test_bench_serve.py)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from kvloom.engine.arg_utils import EngineArgs
from kvloom.entrypoints.cli.main import build_parser, main
from tests.helpers.serve_fakes import fake_serving


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return fake_serving(monkeypatch)


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
    ((engine_args, options, count, _sock),) = launched
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


@pytest.mark.parametrize("count", ["1", "2"])
def test_a_port_in_use_is_found_before_the_model_loads(
    count: str, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # No model /m: had kvloom looked at it before the port, the error would be about the model.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["serve", "/m", "--host", "127.0.0.1", "--port", str(port), "--api-server-count", count])
    assert info.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvloom serve: error: --port: [Errno 98] cannot listen on 127.0.0.1:{port}: Address already "
                           "in use (another server is listening there")  # fmt: skip
    assert "serving" not in caplog.text


def test_help_lists_engine_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-num-seqs", "--enable-prefix-caching",
                 "--max-request-body-bytes", "--max-sequences-per-request", "--max-json-depth"):  # fmt: skip
        assert flag in out


