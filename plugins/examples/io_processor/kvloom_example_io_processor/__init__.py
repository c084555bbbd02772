"""SemanticSearchProcessor: rank documents by the similarity of their embeddings to a query.

Input (``LLM.encode(data)`` or ``POST /pooling {"data": data}``)::

    {"query": "a quick fox", "documents": ["a dog", "the fox"], "top_k": 2}   # top_k optional

Output: ``{"results": [{"index": 1, "score": 0.93}, {"index": 0, "score": 0.41}]}``, best
first, ``score`` the cosine similarity of the document's embedding to the query's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvloom.interfaces import EngineConfig, IOProcessor, PoolingParams, PoolingRequestOutput, PromptType

KVLOOM_PLUGIN_API = "1.0"


@dataclass
class SearchRequest:
    query: str
    documents: list[str]
    top_k: int


class SemanticSearchProcessor(IOProcessor[SearchRequest, dict[str, Any]]):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)  # self.config: the engine's EngineConfig
        self.top_k: dict[str | None, int] = {}  # request id -> top_k, from pre_process to post_process

    def parse_data(self, data: object) -> SearchRequest:
        # Validate the raw input; a ValueError is the caller's error (HTTP 400 online).
        if not isinstance(data, dict) or not isinstance(data.get("query"), str) or not data["query"]:
            raise ValueError('expected {"query": text, "documents": [text, ...], "top_k": n}')
        documents = data.get("documents")
        if not isinstance(documents, list) or not documents or not all(isinstance(d, str) and d for d in documents):
            raise ValueError("documents: expected a non-empty list of non-empty texts")
        top_k = data.get("top_k", len(documents))
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k: expected a positive integer, got {top_k!r}")
        return SearchRequest(data["query"], documents, min(top_k, len(documents)))

    def merge_pooling_params(self, params: PoolingParams | None = None) -> PoolingParams:
        # Cosine similarity needs whole vectors; the model's pooling type is kept.
        merged = params.model_copy() if params is not None else PoolingParams()
        merged.dimensions = None
        return merged

    def pre_process(self, prompt: SearchRequest, request_id: str | None = None, **kwargs: Any) -> Sequence[PromptType]:
        self.top_k[request_id] = prompt.top_k
        return [prompt.query, *prompt.documents]  # one pooled vector per prompt

    def post_process(
        self, model_output: Sequence[PoolingRequestOutput], request_id: str | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        # model_output is in prompt order: the query, then the documents.
        vectors = F.normalize(torch.stack([out.outputs.data.float() for out in model_output]), dim=-1)
        scores = vectors[1:] @ vectors[0]
        top = scores.topk(self.top_k.pop(request_id, len(scores)))
        return {"results": [{"index": i, "score": s} for i, s in zip(top.indices.tolist(), top.values.tolist())]}
