"""The example IO processor (plugins/examples/io_processor), pip-installed: `LLM.encode` on a
pooling model runs it (parse_data -> pre_process -> pooling -> post_process), and its ranking
and scores are HF transformers' mean-pooled embeddings' cosine similarities."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvloom.testing.install import install_distribution, plugin_env
from kvloom.testing.models import tiny_model_dir

SOURCE = Path(__file__).resolve().parents[1]
QUERY = "The quick brown fox"
DOCUMENTS = ["What is the capital of France?", "A quick brown fox jumps.", "Hello world!", "The lazy dog."]

ENCODE = """
import json, sys
from kvloom import LLM
llm = LLM(sys.argv[1], runner="pooling", pooling_type="MEAN", dtype="float32", io_processor_plugin="example_search")
(out,) = llm.encode(json.loads(sys.argv[2]), use_tqdm=False)
print(json.dumps(out.outputs))
try:
    llm.encode({"query": "x", "documents": []}, use_tqdm=False)
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_distribution(SOURCE, tmp_path_factory.mktemp("example-io-processor"))


def hf_mean_embedding(model_dir: Path, text: str) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text).input_ids
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return F.normalize(model(torch.tensor([ids])).last_hidden_state[0].double().mean(0), dim=0)


def test_llm_encode_ranks_documents(site: Path) -> None:
    model = tiny_model_dir("llama")
    data = {"query": QUERY, "documents": DOCUMENTS, "top_k": 3}
    done = subprocess.run([sys.executable, "-c", ENCODE, str(model), json.dumps(data)], env=plugin_env([site]),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result, error = [json.loads(line) for line in done.stdout.strip().splitlines()[-2:]]
    query = hf_mean_embedding(model, QUERY)
    expected = torch.stack([hf_mean_embedding(model, d) for d in DOCUMENTS]) @ query
    ranking = expected.argsort(descending=True)[:3].tolist()
    assert [r["index"] for r in result["results"]] == ranking
    for r in result["results"]:
        assert abs(r["score"] - expected[r["index"]].item()) < 1e-4
    assert error == {"error": "documents: expected a non-empty list of non-empty texts"}
