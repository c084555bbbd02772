"""What a vLLM user's scripts start the server with: a Hugging Face Hub id as the model
(found offline in a cache laid out by the test; CI has no hub), and vLLM's older entry
point ``python -m kvloom.entrypoints.openai.api_server --model ...``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from kvloom.entrypoints.cli.main import main
from kvloom.testing.install import KvloomServer
from tests.helpers.hf_cache import TINY_REPO, make_tiny_hub

OLD_ENTRY_POINT = [sys.executable, "-m", "kvloom.entrypoints.openai.api_server"]
SERVE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a server that finds ``TINY_REPO`` in the test's cache, offline."""
    hub = make_tiny_hub(tmp_path_factory.mktemp("hub"))
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub["cache"])}


def _served_model(server: KvloomServer) -> dict:
    (model,) = server.get("/v1/models").json()["data"]
    completion = server.post("/v1/completions", {"model": model["id"], "prompt": "hi", "max_tokens": 2,
                                                 "ignore_eos": True})  # fmt: skip
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2, completion.text
    return model


def test_serve_a_hub_id_offline(hub_env: dict[str, str], tmp_path: Path) -> None:
    with KvloomServer([TINY_REPO, *SERVE_FLAGS], tmp_path, **hub_env) as server:
        model = _served_model(server)
        assert (model["id"], model["max_model_len"]) == (TINY_REPO, 128)  # the main branch
        assert "from the Hugging Face cache" in server.log() and "HF_HUB_OFFLINE is set" in server.log()


def test_old_entry_point_serves_with_model_flag(hub_env: dict[str, str], tmp_path: Path) -> None:
    args = ["--model", TINY_REPO, "--revision", "other", *SERVE_FLAGS]
    with KvloomServer(args, tmp_path, command=OLD_ENTRY_POINT, **hub_env) as server:
        model = _served_model(server)
        assert (model["id"], model["max_model_len"]) == (TINY_REPO, 256)  # the "other" branch


def test_old_entry_point_help() -> None:
    done = subprocess.run([*OLD_ENTRY_POINT, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "--model" in done.stdout and "--revision" in done.stdout


def test_serve_a_missing_hub_id_says_where_it_looked(hub_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_env["HF_HUB_CACHE"])
    assert main(["serve", "--model", "kvloom-test/missing"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvloom: error: model: 'kvloom-test/missing' is not a local folder or .gguf file")
    assert "models--kvloom-test--missing" in line and "HF_HUB_OFFLINE is set" in line
