"""The example endpoint plugin (plugins/examples/endpoint), pip-installed: `kvloom serve`
serves its route when KVLOOM_PLUGINS names it (tests/registry/test_loader.py checks that it
is not loaded otherwise), behind the API key, and its answer counts tokens as the model's
tokenizer does."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvloom.testing.install import KvloomServer, install_distribution
from kvloom.testing.models import tiny_model_dir

SOURCE = Path(__file__).resolve().parents[1]
ROUTE = "/v1/example/token_count"


def test_served_only_when_named(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    site = install_distribution(SOURCE, tmp_path / "site")
    model = tiny_model_dir("llama")
    args = [str(model), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "64",
            "--api-key", "k", "--disable-log-stats"]  # fmt: skip
    with KvloomServer(args, tmp_path, site_dirs=[site], KVLOOM_PLUGINS="cpu,CPU_ATTN,example_token_count") as server:
        key = {"Authorization": "Bearer k"}
        assert httpx.post(server.url + ROUTE, json={"text": "hi"}).status_code == 401
        answer = httpx.post(server.url + ROUTE, json={"text": "Hello world"}, headers=key, timeout=30).json()
        expected = len(AutoTokenizer.from_pretrained(model).encode("Hello world", add_special_tokens=False))
        assert answer == {"model": str(model), "tokens": expected}  # served name: the model argument as given
        bad = httpx.post(server.url + ROUTE, json={"text": 1}, headers=key, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text"
        assert "Endpoint plugin example_token_count serves /v1/example/token_count" in server.log()
