"""vLLM's served-model-name rules: the default is the model argument exactly as given
(``/path/model``, ``org/name``), ``--served-model-name a b`` gives several names: every one
is accepted in requests and listed by ``/v1/models``, and responses report the first."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from kvloom.engine.arg_utils import EngineArgs
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from kvloom.entrypoints.openai.api_server import build_app
from tests.helpers.serve_fakes import FakeAsyncLLM, make_config


def test_flags_and_defaults(tmp_path, monkeypatch) -> None:
    from kvloom.engine.config_builder import create_engine_config
    from tests.helpers.model_fixtures import tiny_model_dir

    parser = add_engine_args(argparse.ArgumentParser())
    args = engine_args_from_namespace(parser.parse_args(["--served-model-name", "a", "org/b"]))
    assert args.served_model_name == ["a", "org/b"]
    assert EngineArgs(served_model_name="one").served_model_name == ["one"]  # LLM(served_model_name="one")
    for bad in ([], [""], ["a", "a"]):
        with pytest.raises(ValueError, match="served_model_name"):
            EngineArgs(served_model_name=bad)
    # The default is the model argument as given: relative, absolute, or a hub-style name.
    model = tiny_model_dir("llama")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    config = create_engine_config(EngineArgs(model="org/name", dtype="float32")).model
    assert (config.served_model_name, config.served_model_names) == ("org/name", ["org/name"])
    named = create_engine_config(EngineArgs(model=str(model), dtype="float32", served_model_name=["a", "b"])).model
    assert (named.served_model_name, named.served_model_names) == ("a", ["a", "b"])


def test_every_name_is_served_and_the_first_is_reported() -> None:
    engine = FakeAsyncLLM(make_config(served_model_name="/models/llama", served_model_names=["/models/llama", "llama"]))
    client = TestClient(build_app(engine, log_stats=False))
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [("/models/llama", "/models/fake"), ("llama", "/models/fake")]
    for name in ("/models/llama", "llama", None):
        body = {"prompt": "w5 w6", "max_tokens": 2, **({"model": name} if name else {})}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "/models/llama"
        chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2, **({"model": name} if name else {})}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["model"] == "/models/llama"
    streamed = client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2, "model": "llama", "stream": True})
    assert '"model":"/models/llama"' in streamed.text and '"model":"llama"' not in streamed.text
    r = client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2, "model": "other"})
    assert r.status_code == 404
    assert "Available models: /models/llama, llama" in r.json()["error"]["message"]
