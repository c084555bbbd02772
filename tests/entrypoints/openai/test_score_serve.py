"""/v1/score, /score, /v1/rerank, /rerank and /v2/rerank against `kvloom serve` (vLLM's
request and response shapes): a tiny cross-encoder's and a tiny embedding model's scores
agree with sentence-transformers' ``CrossEncoder`` and ``SentenceTransformer``; the API key,
the request limits and the errors are the server's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvloom.testing.install import KvloomServer
from tests.helpers.score_models import (
    DOCUMENTS,
    QUERY,
    bi_encoder_scores,
    cross_encoder_dir,
    cross_encoder_scores,
    embedding_model_dir,
)

KEY = {"Authorization": "Bearer k"}


def serve(model_dir: Path, workdir: Path, *extra: str) -> KvloomServer:
    args = [str(model_dir), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "128",
            "--served-model-name", "scorer", "--api-key", "k", "--disable-log-stats", "--max-sequences-per-request",
            "8", *extra]  # fmt: skip
    return KvloomServer(args, workdir)


@pytest.fixture(scope="module")
def cross(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvloomServer]:
    with serve(cross_encoder_dir("qwen3"), tmp_path_factory.mktemp("cross")) as server:
        yield server


@pytest.fixture(scope="module")
def bi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvloomServer]:
    with serve(embedding_model_dir(), tmp_path_factory.mktemp("bi"), "--runner", "pooling") as server:
        yield server


def post(server: KvloomServer, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=KEY if headers is None else headers, timeout=60)


def test_cross_encoder_scores_and_ranks(cross: KvloomServer) -> None:
    expected = cross_encoder_scores(cross_encoder_dir("qwen3"), [(QUERY, d) for d in DOCUMENTS])
    for path in ("/v1/score", "/score"):
        body = post(cross, path, {"model": "scorer", "text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert body["object"] == "list" and body["id"].startswith("score-") and body["model"] == "scorer"
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and {d["object"] for d in body["data"]} == {"score"}
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    ranking = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = post(cross, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
        assert [r["index"] for r in body["results"]] == ranking[:2]
        assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in ranking[:2]]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[i] for i in ranking[:2]],
                                                                                abs=1e-5)  # fmt: skip
        assert body["usage"]["total_tokens"] > 0 and body["id"].startswith("rerank-")
    body = post(cross, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False}).json()
    assert len(body["results"]) == 4 and all("document" not in r for r in body["results"])


def test_bi_encoder_scores_are_cosines(bi: KvloomServer) -> None:
    pairs = [(QUERY, d) for d in DOCUMENTS]
    body = post(bi, "/v1/score", {"text_1": [QUERY] * 4, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(bi_encoder_scores(embedding_model_dir(), pairs), abs=1e-5)


def test_errors_key_and_limits(cross: KvloomServer) -> None:
    assert post(cross, "/v1/score", {"text_1": "a", "text_2": "b"}, headers={}).status_code == 401
    bad = post(cross, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("text_1: 2 texts for 3 in text_2")
    too_many = post(cross, "/rerank", {"query": "q", "documents": ["d"] * 9})
    assert too_many.status_code == 400 and "--max-sequences-per-request" in too_many.json()["error"]["message"]
    long = post(cross, "/v1/score", {"text_1": "word " * 200, "text_2": "b"})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    cut = post(cross, "/v1/score", {"text_1": "word " * 200, "text_2": "b", "truncate_prompt_tokens": 50})
    assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] == 50
    assert post(cross, "/rerank", {"query": "q", "documents": "d"}).json()["error"]["param"] == "documents"
