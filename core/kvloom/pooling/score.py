"""Scoring text pairs (vLLM's score API: ``LLM.score``, ``/v1/score``, ``/rerank``) with a
pooling model, in one of two ways:

* a cross-encoder (a ``*ForSequenceClassification`` model with one label) reads each pair
  as one prompt, the tokenizer's pair encoding of (text_1, text_2); the score is the
  sigmoid of its logit (sentence-transformers' ``CrossEncoder.predict``);
* a bi-encoder (an embedding model) embeds every text alone; the score is the cosine of
  the two embeddings (``SentenceTransformer.similarity``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvloom.models.registry import is_classification_architecture


def is_cross_encoder(config: Any) -> bool:
    """Whether ``config``'s model scores pairs as a cross-encoder (else: by embeddings)."""
    return is_classification_architecture(config.model.architecture)


def check_scoring_model(config: Any) -> None:
    """A ``ValueError`` unless ``config``'s model can score pairs."""
    if config.model.runner != "pooling":
        raise ValueError(f"The model {config.model.served_model_name} generates text and cannot score pairs; serve "
                         "an embedding model (bi-encoder) or a *ForSequenceClassification model with one label "
                         "(cross-encoder)")  # fmt: skip
    labels = int(getattr(config.model.hf_config, "num_labels", 1))
    if is_cross_encoder(config) and labels != 1:
        raise ValueError(f"The model {config.model.served_model_name} classifies into {labels} labels; scoring "
                         "needs a cross-encoder with one label")  # fmt: skip


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str], names: tuple[str, str] = ("text_1", "text_2")
                ) -> list[tuple[str, str]]:  # fmt: skip
    """vLLM's pairing: one first text against every second text, or the two lists pairwise
    (a ``ValueError`` naming the fields when their lengths differ)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError(f"{names[0] if not firsts else names[1]}: must not be empty")
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(f"{names[0]}: {len(firsts)} texts for {len(seconds)} in {names[1]} (give one text, or as "
                         "many as the other list)")  # fmt: skip
    return list(zip(firsts, seconds))


class ScorePlan:
    """What to pool for ``pairs`` and how their scores follow: a cross-encoder pools one
    prompt per pair (``prompts``: token ids), a bi-encoder each distinct text once
    (``prompts``: texts)."""

    def __init__(self, config: Any, tokenizer: Any, pairs: list[tuple[str, str]]) -> None:
        check_scoring_model(config)
        self.pairs = pairs
        self.cross = is_cross_encoder(config)
        self.prompts: list[list[int]] | list[str]
        if self.cross:
            self.prompts = [pair_token_ids(tokenizer, a, b) for a, b in pairs]
        else:
            self.prompts = list(dict.fromkeys(text for pair in pairs for text in pair))
        self._index = {text: i for i, text in enumerate(self.prompts)} if not self.cross else {}

    def sources(self, pair: int) -> list[int]:
        """The prompts pair ``pair``'s score is made of."""
        if self.cross:
            return [pair]
        first, second = self.pairs[pair]
        return [self._index[first], self._index[second]]

    def scores(self, pooled: list[torch.Tensor]) -> list[float]:
        """One score per pair from the prompts' pooled outputs (in ``prompts``' order)."""
        if self.cross:
            return [cross_encoder_score(p) for p in pooled]
        return [cosine_score(*(pooled[i] for i in self.sources(k))) for k in range(len(self.pairs))]


def pair_token_ids(tokenizer: Any, first: str, second: str) -> list[int]:
    """The cross-encoder prompt of a pair: the tokenizer's pair encoding (its special tokens
    and separators, as ``CrossEncoder`` feeds the model)."""
    return list(tokenizer(first, text_pair=second, add_special_tokens=True)["input_ids"])


def cross_encoder_score(pooled: torch.Tensor) -> float:
    """A pair's relevance from the model's one logit."""
    return float(torch.sigmoid(pooled.float().reshape(-1)[0]))


def cosine_score(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine of two embeddings."""
    return float(F.cosine_similarity(a.float().reshape(1, -1), b.float().reshape(1, -1))[0])
