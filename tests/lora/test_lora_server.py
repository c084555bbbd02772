"""LoRA through a real `kvloom serve` subprocess: adapters in /v1/models, requests selecting
an adapter by `model`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter, and the
first-party filesystem resolver (plugins/lora_filesystem_resolver, pip-installed here)
loading an adapter on its first request, with each of its error cases.

The resolver's own unit tests (directory not set or invalid, not found, bad names) run
in-process at the end.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.lora_fixtures import edit_adapter_config, hf_greedy, make_adapter
from tests.helpers.model_fixtures import tiny_model_dir
from tests.helpers.plugin_server import REPO, KvloomServer, install_distribution

RESOLVER_SRC = REPO / "plugins" / "lora_filesystem_resolver"
SERVED = "tiny-llama"
PROMPT = [5, 17, 33, 48, 90, 11]
MAX_NEW = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-adapters")
    made = {
        "good": make_adapter(base, root / "good", seed=11, r=8),
        "static": make_adapter(base, root / "static", seed=12, r=4, target_modules=["q_proj", "v_proj"]),
        "too_big": make_adapter(base, root / "too_big", seed=13, r=16),
    }
    # Normal PEFT adapters: they record the tiny model's path as their base model, which the
    # server serves as SERVED; kvloom does not compare the two (nor does vLLM's server).
    for name in ("wrong_peft", "other_base"):
        made[name] = Path(shutil.copytree(made["good"], root / name))
    edit_adapter_config(made["wrong_peft"], peft_type="IA3")
    edit_adapter_config(made["other_base"], base_model_name_or_path="another/model")
    return made


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]) -> Iterator[KvloomServer]:
    work = tmp_path_factory.mktemp("lora-server")
    site = install_distribution(RESOLVER_SRC, work)
    cache_dir = adapters["good"].parent  # every adapter directory, by name
    args = [str(tiny_model_dir("llama")), "--served-model-name", SERVED, "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"static={adapters['static']}", "--max-model-len", "128",
            "--disable-log-stats", "--skip-tokenizer-init"]  # fmt: skip
    with KvloomServer(args, work, [site], KVLOOM_ALLOW_RUNTIME_LORA_UPDATING="1",
                      KVLOOM_LORA_RESOLVER_CACHE_DIR=str(cache_dir)) as srv:  # fmt: skip
        yield srv


def _complete(server: KvloomServer, model: str) -> tuple[int, dict]:
    response = server.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW,
                                               "temperature": 0, "ignore_eos": True, "logprobs": 0})  # fmt: skip
    return response.status_code, response.json()


def _tokens(body: dict) -> list[int]:
    # The server runs without a tokenizer, so logprob tokens are "token_id:N".
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def _model_ids(server: KvloomServer) -> dict[str, str | None]:
    return {card["id"]: card["parent"] for card in server.get("/v1/models").json()["data"]}


def test_static_adapter_is_listed_and_served(server: KvloomServer, adapters: dict[str, Path]) -> None:
    assert _model_ids(server) == {SERVED: None, "static": SERVED}
    base = tiny_model_dir("llama")
    status, body = _complete(server, "static")
    assert status == 200, body
    assert _tokens(body) == (hf_greedy(base, adapters["static"], PROMPT, MAX_NEW))
    status, body = _complete(server, SERVED)
    assert _tokens(body) == (hf_greedy(base, None, PROMPT, MAX_NEW))


def test_resolver_loads_an_adapter_on_its_first_request(server: KvloomServer, adapters: dict[str, Path]) -> None:
    assert "good" not in _model_ids(server)
    status, body = _complete(server, "good")
    assert status == 200, body
    assert _tokens(body) == (hf_greedy(tiny_model_dir("llama"), adapters["good"], PROMPT, MAX_NEW))
    assert _model_ids(server)["good"] == SERVED
    assert "LoRA resolver lora_filesystem_resolver found adapter good" in server.log()


@pytest.mark.parametrize(
    "name, status, message",
    [
        ("wrong_peft", 400, "peft_type is 'IA3'; only 'LORA' is supported"),
        ("too_big", 400, "LoRA rank 16 exceeds max_lora_rank 8"),
        ("missing", 404, "LoRA adapter not found by the resolvers: lora_filesystem_resolver"),
    ],
)
def test_resolver_errors(server: KvloomServer, name: str, status: int, message: str) -> None:
    got, body = _complete(server, name)
    assert got == status, body
    assert message in body["error"]["message"]
    assert name not in _model_ids(server)


def test_the_recorded_base_model_is_not_enforced(server: KvloomServer, adapters: dict[str, Path]) -> None:
    # Its config names another base model; its matrices fit this model, so it is served.
    status, body = _complete(server, "other_base")
    assert status == 200, body
    assert _tokens(body) == hf_greedy(tiny_model_dir("llama"), adapters["good"], PROMPT, MAX_NEW)


def test_load_and_unload_lora_adapter(server: KvloomServer, adapters: dict[str, Path]) -> None:
    response = server.post("/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(adapters["static"])})
    assert response.status_code == 200, response.text
    assert _model_ids(server)["dyn"] == SERVED
    status, body = _complete(server, "dyn")
    assert status == 200 and _tokens(body) == _tokens(_complete(server, "static")[1])
    again = server.post("/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(adapters["static"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(adapters["too_big"])})
    assert bad.status_code == 400 and "exceeds max_lora_rank 8" in bad.json()["error"]["message"]
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "dyn"}).status_code == 200
    assert "dyn" not in _model_ids(server)
    assert _complete(server, "dyn")[0] == 404
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "dyn"}).status_code == 404


# ----------------------------------------------------------------- the resolver in-process


@pytest.fixture()
def resolver(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(RESOLVER_SRC))
    sys.modules.pop("kvloom_lora_filesystem_resolver", None)
    from kvloom_lora_filesystem_resolver import FilesystemResolver

    return FilesystemResolver()


def test_resolver_needs_a_valid_cache_dir(resolver, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVLOOM_LORA_RESOLVER_CACHE_DIR", raising=False)
    with pytest.raises(ValueError, match="KVLOOM_LORA_RESOLVER_CACHE_DIR must be set to a valid directory"):
        asyncio.run(resolver.resolve_lora(SERVED, "good"))
    monkeypatch.setenv("KVLOOM_LORA_RESOLVER_CACHE_DIR", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="must be set to a valid directory"):
        asyncio.run(resolver.resolve_lora(SERVED, "good"))


def test_resolver_finds_or_refuses(resolver, monkeypatch: pytest.MonkeyPatch, adapters: dict[str, Path]) -> None:
    monkeypatch.setenv("KVLOOM_LORA_RESOLVER_CACHE_DIR", str(adapters["good"].parent))
    found = asyncio.run(resolver.resolve_lora(SERVED, "good"))
    assert found is not None and found.lora_path == str(adapters["good"]) and found.base_model_name == SERVED
    assert asyncio.run(resolver.resolve_lora(SERVED, "missing")) is None
    with pytest.raises(ValueError, match="peft_type"):
        asyncio.run(resolver.resolve_lora(SERVED, "wrong_peft"))
    with pytest.raises(ValueError, match="not a valid adapter name"):
        asyncio.run(resolver.resolve_lora(SERVED, "../good"))
