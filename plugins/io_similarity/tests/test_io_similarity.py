"""The example IO processor plugin (plugins/io_similarity, pip-installed here) through
``LLM.encode`` (chosen by the model config's ``io_processor_plugin``) and through
``POST /pooling`` of a real `kvloom serve` (chosen by ``--io-processor-plugin``); the same
server's ``/v1/embeddings`` and plain ``/pooling`` against HF transformers."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.model_fixtures import tiny_model_dir
from tests.helpers.plugin_server import REPO, KvloomServer, install_distribution, plugin_env

PLUGIN_SRC = REPO / "plugins" / "io_similarity"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "A quick brown fox.", "What is the capital of France?"]
TOL = 1e-4


def hf_embedding(model_dir: Path, text_or_ids: str | list[int], pooling: str = "MEAN") -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    if isinstance(text_or_ids, list):
        ids = text_or_ids
    else:
        ids = AutoTokenizer.from_pretrained(model_dir)(text_or_ids).input_ids
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].double()
    return F.normalize(hidden.mean(0) if pooling == "MEAN" else hidden[-1], dim=0)


def reference_similarity(model_dir: Path) -> torch.Tensor:
    embeddings = torch.stack([hf_embedding(model_dir, d) for d in DOCUMENTS])
    return embeddings @ embeddings.T


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_distribution(PLUGIN_SRC, tmp_path_factory.mktemp("io-plugin"))


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("llama")


def test_llm_encode_runs_the_plugin_named_in_the_model_config(site: Path, model_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    config["io_processor_plugin"] = "document_similarity"
    (model / "config.json").write_text(json.dumps(config))
    script = f"""
import json
from kvloom import LLM
llm = LLM({str(model)!r}, runner="pooling", pooling_type="MEAN", dtype="float32")
assert type(llm.io_processor).__name__ == "DocumentSimilarityProcessor", llm.io_processor
(out,) = llm.encode({{"documents": {DOCUMENTS!r}}}, use_tqdm=False)
print(json.dumps(out.outputs))
try:
    llm.encode({{"documents": []}}, use_tqdm=False)
except ValueError as exc:
    print(json.dumps({{"error": str(exc)}}))
"""
    done = subprocess.run([sys.executable, "-c", script], env=plugin_env([site]), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result, error = [json.loads(line) for line in done.stdout.strip().splitlines()[-2:]]
    expected = reference_similarity(model_dir)
    assert (torch.tensor(result["similarity"], dtype=torch.float64) - expected).abs().max().item() <= TOL
    others = expected.clone().fill_diagonal_(float("-inf"))
    assert result["most_similar"] == others.argmax(1).tolist()
    assert error == {"error": "documents: expected a list of 1..256 texts"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, site: Path, model_dir: Path) -> Iterator[KvloomServer]:
    args = [str(model_dir), "--runner", "pooling", "--pooling-type", "MEAN", "--io-processor-plugin",
            "document_similarity", "--served-model-name", "tiny-embed", "--max-model-len", "128",
            "--disable-log-stats"]  # fmt: skip
    with KvloomServer(args, tmp_path_factory.mktemp("io-server"), [site]) as srv:
        yield srv


def test_pooling_endpoint_runs_the_plugin(server: KvloomServer, model_dir: Path) -> None:
    response = server.post("/pooling", {"model": "tiny-embed", "data": {"documents": DOCUMENTS}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["request_id"].startswith("pool-") and isinstance(body["created_at"], int)
    similarity = torch.tensor(body["data"]["similarity"], dtype=torch.float64)
    assert (similarity - reference_similarity(model_dir)).abs().max().item() <= TOL
    bad = server.post("/pooling", {"data": {"documents": ["ok", ""]}})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "data: documents[1]: expected a non-empty string"


def test_plain_pooling_and_embeddings_match_hf(server: KvloomServer, model_dir: Path) -> None:
    expected = [hf_embedding(model_dir, d) for d in DOCUMENTS]
    response = server.post("/v1/embeddings", {"model": "tiny-embed", "input": DOCUMENTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "tiny-embed"
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][0]["object"] == "embedding"
    for item, ref in zip(body["data"], expected):
        assert (torch.tensor(item["embedding"], dtype=torch.float64) - ref).abs().max().item() <= TOL
    from transformers import AutoTokenizer

    num_tokens = sum(len(AutoTokenizer.from_pretrained(model_dir)(d).input_ids) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": num_tokens, "completion_tokens": 0, "total_tokens": num_tokens}

    # base64 (little-endian float32) and token-id input.
    ids = [5, 17, 33, 48]
    b64 = server.post("/v1/embeddings", {"input": ids, "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert (torch.from_numpy(vector.copy()).double() - hf_embedding(model_dir, ids)).abs().max().item() <= TOL

    # dimensions: the first 16 pooled values, then normalised (OpenAI's Matryoshka truncation).
    short = server.post("/v1/embeddings", {"input": [ids], "dimensions": 16}).json()["data"][0]["embedding"]
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        raw = hf(torch.tensor([ids])).last_hidden_state[0].double().mean(0)[:16]
    assert (torch.tensor(short, dtype=torch.float64) - F.normalize(raw, dim=0)).abs().max().item() <= TOL

    pooled = server.post("/pooling", {"input": DOCUMENTS[0]}).json()
    assert pooled["data"][0]["object"] == "pooling"
    assert (torch.tensor(pooled["data"][0]["data"], dtype=torch.float64) - expected[0]).abs().max().item() <= TOL


def test_embedding_errors(server: KvloomServer) -> None:
    too_long = server.post("/v1/embeddings", {"input": [1] * 129})
    assert too_long.status_code == 400 and "maximum context length is 128" in too_long.json()["error"]["message"]
    assert server.post("/v1/embeddings", {"input": []}).status_code == 400
    unknown = server.post("/v1/embeddings", {"input": "x", "model": "nope"})
    assert unknown.status_code == 404
    generate = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert generate.status_code == 400 and "cannot generate" in generate.json()["error"]["message"]
