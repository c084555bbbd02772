"""MeanEmbeddingProcessor: {"texts": [...]} in, one L2-normalised mean embedding out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvloom.interfaces import IOProcessor, PromptType

KVLOOM_PLUGIN_API = "1.0"


class MeanEmbeddingProcessor(IOProcessor[list[str], dict[str, Any]]):
    def parse_data(self, data: object) -> list[str]:
        if not isinstance(data, dict) or not isinstance(data.get("texts"), list):
            raise ValueError('data: expected {"texts": [str, ...]}')
        texts = data["texts"]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ValueError("data.texts: expected a non-empty list of non-empty strings")
        return texts

    def pre_process(self, prompt: list[str], request_id: str | None = None, **kwargs: Any) -> Sequence[PromptType]:
        return list(prompt)

    def post_process(self, model_output: Sequence[Any], request_id: str | None = None, **kwargs: Any) -> dict[str, Any]:
        embeddings = torch.stack([out.outputs.data.float() for out in model_output])
        mean = embeddings.mean(dim=0)
        return {"embedding": torch.nn.functional.normalize(mean, dim=0).tolist(), "num_texts": len(model_output)}
