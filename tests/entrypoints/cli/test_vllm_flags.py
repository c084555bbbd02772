"""Every vLLM serve flag in ``kvloom.entrypoints.cli.vllm_flags.VLLM_FLAGS`` works, is
refused with "<flag> is not supported by kvloom yet", or is ignored with a warning; never
argparse's "unrecognized arguments" (issue 18, item 3). And the server flags reach the
app and uvicorn."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvloom.engine.arg_utils import EngineArgs
from kvloom.engine.config_builder import create_engine_config
from kvloom.entrypoints.cli.main import main
from kvloom.entrypoints.cli.vllm_flags import VLLM_FLAGS
from kvloom.entrypoints.openai.server_options import FrontendOptions
from kvloom.loader.generation_config import generation_defaults, resolve_chat_template
from tests.helpers.model_fixtures import tiny_model_dir
from tests.helpers.serve_fakes import fake_serving


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return fake_serving(monkeypatch)


def parser_flags() -> set[str]:
    from kvloom.entrypoints.cli.main import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return set(serve._option_string_actions)


def _tls_files(tmp_path: Path) -> tuple[str, str]:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)  # fmt: skip
    return str(key), str(cert)


@pytest.mark.parametrize("entry", VLLM_FLAGS, ids=lambda e: e.flag)
def test_every_vllm_flag_works_or_says_why_not(entry, served, capsys, caplog, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    example = list(entry.example)
    if entry.flag in ("--ssl-keyfile", "--ssl-certfile"):
        key, cert = _tls_files(tmp_path)
        argv = ["serve", "--ssl-keyfile", key, "--ssl-certfile", cert]
    else:
        argv = ["serve", entry.flag, *example]
    if entry.status == "not supported yet":
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert entry.flag in err and "is not supported by kvloom yet" in err and "unrecognized" not in err
        # One line saying why, one saying where the usage is (not the hundred lines of usage first).
        error, hint = err.splitlines()
        assert error.startswith("kvloom serve: error: ") and hint == "Run 'kvloom serve --help' for usage."
        return
    if entry.status == "works":
        assert entry.flag in parser_flags()
    with caplog.at_level(logging.WARNING):
        assert main(argv) == 0, capsys.readouterr().err
    assert len(served) == 1
    if entry.status == "ignored":
        # The kvloom command configures its logger (own stderr handler, no propagation to
        # caplog's root handler), so the warning may arrive either way.
        assert f"{entry.flag} is ignored by kvloom" in caplog.text + capsys.readouterr().err


def test_the_model_after_an_ignored_flag_is_still_the_model(served) -> None:
    main(["serve", "--swap-space", "4", "--disable-frontend-multiprocessing", "/models/m"])
    assert served[0]["engine_args"].model == "/models/m"


def test_server_flags_reach_the_frontend_options(served, tmp_path) -> None:
    key, cert = _tls_files(tmp_path)
    main(["serve", "--allowed-origins", json.dumps(["https://a.example"]), "--allow-credentials", "--root-path", "/api",
          "--response-role", "bot", "--enable-log-requests", "--ssl-keyfile", key, "--ssl-certfile", cert])  # fmt: skip
    frontend: FrontendOptions = served[0]["frontend"]
    assert frontend.cors and frontend.allowed_origins == ("https://a.example",) and frontend.allow_credentials
    assert frontend.response_role == "bot" and frontend.enable_log_requests
    assert frontend.uvicorn_kwargs() == {"ssl_keyfile": key, "ssl_certfile": cert, "root_path": "/api"}
    import uvicorn

    config = uvicorn.Config(lambda *a: None, **frontend.uvicorn_kwargs())
    config.load()  # uvicorn reads the key and certificate into its SSL context
    assert config.is_ssl


@pytest.mark.parametrize("argv,message", [
    (["--ssl-keyfile", "/nope.pem"], "--ssl-keyfile and --ssl-certfile: give both"),
    (["--allowed-origins", "*"], "--allowed-origins: expected a JSON list of strings"),
    (["--root-path", "api"], "--root-path: 'api' must start with '/'"),
    (["--max-logprobs", "21"], "--max-logprobs"),
    (["--enable-log-requests", "--disable-log-requests"], "not allowed with argument"),
])  # fmt: skip
def test_bad_server_flags_are_named(served, capsys, argv, message) -> None:
    with pytest.raises(SystemExit):
        main(["serve", *argv])
    assert message in capsys.readouterr().err


def test_generation_config(tmp_path) -> None:
    model = Path(tiny_model_dir("llama"))
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 7,
         "do_sample": True, "bos_token_id": 1}))  # fmt: skip
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 7}
    assert generation_defaults(str(folder), model) == expected
    assert generation_defaults("vllm", folder) == {} and generation_defaults("kvloom", folder) == {}
    assert generation_defaults("auto", folder) == expected  # 'auto': the model's own folder
    with pytest.raises(ValueError, match="generation_config: '/nope' is not a folder"):
        generation_defaults("/nope", model)
    config = create_engine_config(EngineArgs(model=str(model), dtype="float32", generation_config=str(folder)))
    assert config.model.generation_defaults == expected


def test_chat_template_from_a_file_or_inline(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}!")
    assert resolve_chat_template(str(path)) == "{{ messages[0]['content'] }}!"
    assert resolve_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="neither a file nor an inline Jinja template"):
        resolve_chat_template("missing.jinja")
    from kvloom import LLM

    llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", chat_template=str(path), kv_cache_memory="8MiB")
    try:
        assert llm.get_tokenizer().chat_template == "{{ messages[0]['content'] }}!"
    finally:
        llm.llm_engine.shutdown()


def test_the_python_api_uses_the_generation_config(tmp_path) -> None:
    import shutil

    from kvloom import LLM

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(model=str(model), dtype="float32", kv_cache_memory="8MiB", max_model_len=64)
    try:
        defaults = llm.get_default_sampling_params()
        assert defaults.temperature == 0.0 and defaults.max_tokens == 3
        assert len(llm.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids) == 3
    finally:
        llm.llm_engine.shutdown()


def test_max_logprobs_limits_the_python_api_too() -> None:
    from kvloom import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", max_model_len=64,
              max_logprobs=2)  # fmt: skip
    try:
        with pytest.raises(ValueError, match=r"logprobs: 3 is more than this engine allows.*<= 2, max_logprobs"):
            llm.generate("Hello", SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)
        assert llm.generate("Hello", SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)[0].outputs[0].logprobs
    finally:
        llm.llm_engine.shutdown()


def test_frontend_options_shape_the_app(caplog) -> None:
    from fastapi.testclient import TestClient

    from kvloom.entrypoints.openai.api_server import build_app
    from tests.helpers.serve_fakes import FakeAsyncLLM

    chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 1}
    plain = TestClient(build_app(FakeAsyncLLM(), log_stats=False))
    assert plain.get("/docs").status_code == 200
    assert "access-control-allow-origin" not in plain.options(
        "/v1/models", headers={"Origin": "https://a.example", "Access-Control-Request-Method": "GET"}).headers
    assert plain.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["role"] == "assistant"

    frontend = FrontendOptions(response_role="bot", disable_fastapi_docs=True, cors=True, enable_log_requests=True,
                               allowed_origins=("https://a.example",))  # fmt: skip
    client = TestClient(build_app(FakeAsyncLLM(), log_stats=False, frontend=frontend))
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
    preflight = client.options("/v1/models", headers={"Origin": "https://a.example",
                                                      "Access-Control-Request-Method": "GET"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://a.example"
    with caplog.at_level(logging.INFO, logger="kvloom.entrypoints.openai.serving_engine"):
        reply = client.post("/v1/chat/completions", json=chat).json()
    assert reply["choices"][0]["message"]["role"] == "bot"
    assert "Received request chatcmpl-" in caplog.text
