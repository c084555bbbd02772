"""The example LoRA resolver (plugins/examples/lora_resolver), pip-installed into a real
`kvloom serve --enable-lora`: a model name found in the index loads that adapter (greedy
tokens of HF transformers + peft, then listed in /v1/models), an unknown name is a 404
naming the resolver, an unusable adapter a 400 with the resolver's reason."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloom.testing.install import KvloomServer, install_distribution
from kvloom.testing.lora import edit_adapter_config, make_adapter
from kvloom.testing.models import hf_greedy_tokens, tiny_model_dir

SOURCE = Path(__file__).resolve().parents[1]
SERVED = "tiny-llama"
PROMPT = [5, 17, 33, 48, 90, 11]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("example-adapters")
    # A normal PEFT adapter: its config records the tiny model's path as the base model,
    # and the server serves that model as "tiny-llama". kvloom does not compare the two.
    good = make_adapter(tiny_model_dir("llama"), root / "sql", seed=21, r=8)
    broken = Path(shutil.copytree(good, root / "broken"))
    edit_adapter_config(broken, peft_type="IA3")
    return {"sql": good, "broken": broken}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]) -> Iterator[KvloomServer]:
    work = tmp_path_factory.mktemp("example-lora-server")
    index = work / "adapters.json"
    index.write_text(json.dumps({name: str(path) for name, path in adapters.items()}))
    site = install_distribution(SOURCE, work)
    args = [str(tiny_model_dir("llama")), "--served-model-name", SERVED, "--enable-lora", "--max-lora-rank", "8",
            "--max-model-len", "128", "--disable-log-stats", "--skip-tokenizer-init"]  # fmt: skip
    with KvloomServer(args, work, [site], KVLOOM_ALLOW_RUNTIME_LORA_UPDATING="1", KVLOOM_LORA_INDEX=str(index)) as srv:
        yield srv


def _complete(server: KvloomServer, model: str) -> tuple[int, dict]:
    response = server.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 6,
                                               "temperature": 0, "ignore_eos": True, "logprobs": 0})  # fmt: skip
    return response.status_code, response.json()


def test_resolves_an_adapter_from_the_index(server: KvloomServer, adapters: dict[str, Path]) -> None:
    status, body = _complete(server, "sql")
    assert status == 200, body
    tokens = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
    assert [tokens] == hf_greedy_tokens(tiny_model_dir("llama"), [PROMPT], 6, adapter_dir=adapters["sql"])
    cards = {card["id"]: card for card in server.get("/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == SERVED and cards["sql"]["root"] == str(adapters["sql"])
    assert "LoRA resolver example_index found adapter sql" in server.log()


def test_unknown_and_unusable_adapters(server: KvloomServer) -> None:
    status, body = _complete(server, "missing")
    assert status == 404, body
    assert "LoRA adapter not found by the resolvers: example_index" in body["error"]["message"]
    status, body = _complete(server, "broken")
    assert status == 400, body
    assert "resolver example_index refused it: LoRA adapter broken: peft_type is 'IA3'" in body["error"]["message"]
