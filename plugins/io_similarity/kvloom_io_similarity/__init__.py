"""DocumentSimilarityProcessor: ``{"documents": [text, ...]}`` in, the cosine similarity
matrix of the documents' embeddings out.

Select it with ``--io-processor-plugin document_similarity`` (or ``"io_processor_plugin":
"document_similarity"`` in the model's config.json) on a pooling (embedding) model, then

* offline: ``LLM(model, io_processor_plugin="document_similarity").encode({"documents": [...]})``
  returns one ``PoolingRequestOutput`` whose ``outputs`` is the result below;
* online: ``POST /pooling`` with ``{"data": {"documents": [...]}}`` answers
  ``{"request_id", "created_at", "data": <result>}``.

Result: ``{"similarity": [[float]] (n x n, symmetric, 1 on the diagonal),
"most_similar": [int] (for each document the index of its closest other document, or
null for a single document), "num_tokens": [int]}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvloom.interfaces import IOProcessor, PoolingParams, PromptType

KVLOOM_PLUGIN_API = "1.0"

MAX_DOCUMENTS = 256


class DocumentSimilarityProcessor(IOProcessor[list[str], dict[str, Any]]):
    def parse_data(self, data: object) -> list[str]:
        if not isinstance(data, dict) or set(data) != {"documents"}:
            raise ValueError('expected {"documents": [text, ...]}')
        documents = data["documents"]
        if not isinstance(documents, list) or not 1 <= len(documents) <= MAX_DOCUMENTS:
            raise ValueError(f"documents: expected a list of 1..{MAX_DOCUMENTS} texts")
        for i, text in enumerate(documents):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"documents[{i}]: expected a non-empty string")
        return documents

    def merge_pooling_params(self, params: PoolingParams | None = None) -> PoolingParams:
        # Cosine similarity needs whole vectors; the model's pooling type is kept.
        merged = params.model_copy() if params is not None else PoolingParams()
        merged.dimensions = None
        return merged

    def pre_process(self, prompt: list[str], request_id: str | None = None, **kwargs: Any) -> Sequence[PromptType]:
        return list(prompt)  # one embedding per document

    def post_process(self, model_output: Sequence[Any], request_id: str | None = None, **kwargs: Any) -> dict[str, Any]:
        embeddings = F.normalize(torch.stack([out.outputs.data.double() for out in model_output]), dim=-1)
        similarity = embeddings @ embeddings.T
        n = similarity.shape[0]
        most_similar: list[int | None] = [None] * n
        if n > 1:
            others = similarity.clone()
            others.fill_diagonal_(float("-inf"))
            most_similar = others.argmax(dim=1).tolist()
        return {
            "similarity": similarity.tolist(),
            "most_similar": most_similar,
            "num_tokens": [len(out.prompt_token_ids) for out in model_output],
        }
