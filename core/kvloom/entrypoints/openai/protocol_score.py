"""Bodies of vLLM's score and rerank APIs (``/v1/score``, ``/score``; ``/v1/rerank``,
``/rerank``, ``/v2/rerank``: Jina's and Cohere's rerank shape)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvloom.entrypoints.openai.protocol import OpenAIRequest, OpenAIResponse, ResponseHead, UsageInfo

#: A text of a score or rerank request.
Text = str
#: The most texts on one side of a request (each is at least one engine request).
MAX_TEXTS = 4096


class ScoreRequest(OpenAIRequest):
    """Score ``text_1`` against ``text_2``: one text against each of a list, or two lists of
    the same length pairwise."""

    model: str | None = None
    text_1: Text | list[Text] = Field(max_length=MAX_TEXTS)
    text_2: Text | list[Text] = Field(max_length=MAX_TEXTS)
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    """Keep only the last N tokens of each prompt (vLLM's option)."""
    user: str | None = None


class RerankRequest(OpenAIRequest):
    """Rank ``documents`` by their relevance to ``query``."""

    model: str | None = None
    query: Text
    documents: list[Text] = Field(min_length=1, max_length=MAX_TEXTS)
    top_n: int = Field(0, ge=0)
    """Return the best ``top_n`` (0: all)."""
    return_documents: bool = True
    """Include each document's text in its result (Cohere's option)."""
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    user: str | None = None


class ScoreData(OpenAIResponse):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseHead):
    object: Literal["list"] = "list"
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(OpenAIResponse):
    text: str


class RerankResult(OpenAIResponse):
    index: int
    document: RerankDocument | None = Field(None, exclude_if=lambda v: v is None)
    relevance_score: float


class RerankUsage(OpenAIResponse):
    total_tokens: int


class RerankResponse(OpenAIResponse):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
