"""Cross-encoders (Llama's and Qwen3's ``*ForSequenceClassification`` with one label) and
``LLM.score``: the classification head's logit agrees with HF transformers, and scores
agree with sentence-transformers' ``CrossEncoder`` (sigmoid of the logit) and, for an
embedding model, ``SentenceTransformer``'s cosine; vLLM's pairing rules."""

from __future__ import annotations

import pytest
import torch

from kvloom import LLM, PoolingParams
from kvloom.pooling.score import score_pairs
from tests.helpers.score_models import (
    DOCUMENTS,
    QUERY,
    bi_encoder_scores,
    cross_encoder_dir,
    cross_encoder_scores,
    embedding_model_dir,
)


@pytest.fixture(autouse=True)
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cross_encoder_logits_and_scores(arch: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = cross_encoder_dir(arch)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", disable_log_stats=True)
    assert llm.config.model.runner == "pooling" and not llm.config.model.normalize
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(QUERY)["input_ids"]
    (out,) = llm.encode({"prompt_token_ids": ids}, PoolingParams(), use_tqdm=False)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(out.outputs.data, expected, rtol=1e-4, atol=1e-5)

    scores = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    reference = cross_encoder_scores(model_dir, [(QUERY, d) for d in DOCUMENTS])
    assert scores == pytest.approx(reference, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == len(DOCUMENTS)  # the documents score differently
    llm.llm_engine.shutdown()


def test_bi_encoder_scores_are_cosines() -> None:
    llm = LLM(str(embedding_model_dir()), runner="pooling", dtype="float32", kv_cache_memory="8MiB",
              disable_log_stats=True)  # fmt: skip
    pairs = [(QUERY, d) for d in DOCUMENTS]
    outs = llm.score([q for q, _ in pairs], [d for _, d in pairs], use_tqdm=False)
    assert [o.outputs.score for o in outs] == pytest.approx(bi_encoder_scores(embedding_model_dir(), pairs), abs=1e-5)
    with pytest.raises(ValueError, match="data_1: 2 texts for 4 in data_2"):
        llm.score(["a", "b"], DOCUMENTS)
    llm.llm_engine.shutdown()


def test_pairing_rules() -> None:
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], "a") == [("q", "a")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(ValueError, match="text_2: must not be empty"):
        score_pairs("q", [])


def test_a_generative_model_cannot_score() -> None:
    from kvloom.testing.models import tiny_model_dir

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", disable_log_stats=True)
    with pytest.raises(ValueError, match="generates text and cannot score pairs"):
        llm.score("q", "a")
    llm.llm_engine.shutdown()
