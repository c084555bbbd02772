"""Tiny scoring models for the score and rerank tests: a cross-encoder (an HF
``*ForSequenceClassification`` with one label, random weights) and the tiny Llama as an
embedding model (bi-encoder), with their sentence-transformers references."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import torch

from kvloom.testing.models import build_tokenizer, tiny_hf_config, tiny_model_dir

QUERY = "The quick brown fox"
DOCUMENTS = ["What is the capital of France?", "A quick brown fox jumps.", "Hello world!", "The lazy dog sleeps."]


@functools.lru_cache(maxsize=None)
def cross_encoder_dir(arch: str) -> Path:
    """A tiny random ``arch`` (``llama``, ``qwen3``) ``*ForSequenceClassification`` with one
    label and the tiny tokenizer (without a chat template), saved once per process."""
    from transformers import AutoModelForSequenceClassification

    out = Path(tempfile.mkdtemp(prefix=f"kvloom-cross-encoder-{arch}-"))
    tokenizer = build_tokenizer()
    # A classic cross-encoder reads the pair's plain encoding (sentence-transformers would
    # render a tokenizer's chat template around the pair instead).
    tokenizer.chat_template = None
    config = tiny_hf_config(arch, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=None)
def embedding_model_dir() -> Path:
    """The tiny Llama, to serve as an embedding model (``--runner pooling``, LAST pooling:
    sentence-transformers' default for a decoder), its tokenizer without a chat template (as
    the cross-encoder's, so that sentence-transformers embeds the plain text)."""
    from transformers import AutoTokenizer

    out = Path(tempfile.mkdtemp(prefix="kvloom-bi-encoder-"))
    shutil.copytree(tiny_model_dir("llama"), out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def cross_encoder_scores(model_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(model_dir), device="cpu")
    return [float(s) for s in model.predict(pairs, batch_size=len(pairs))]


def bi_encoder_scores(model_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """sentence-transformers' cosine of last-token embeddings (its default pooling for a
    decoder checkpoint without a sentence-transformers config)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    firsts = model.encode([a for a, _ in pairs], convert_to_tensor=True)
    seconds = model.encode([b for _, b in pairs], convert_to_tensor=True)
    return [float(model.similarity(firsts[i : i + 1], seconds[i : i + 1])[0, 0]) for i in range(len(pairs))]
