"""POST /v1/score (and /score), /v1/rerank (and /rerank, /v2/rerank): vLLM's score and rerank
APIs over a pooling model (``kvloom.pooling.score``): a cross-encoder scores each (text_1,
text_2) pair as one prompt, an embedding model by the cosine of the two embeddings. A rerank
is a score of the query against every document, sorted."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvloom.entrypoints.openai.errors import APIError
from kvloom.entrypoints.openai.protocol import UsageInfo
from kvloom.entrypoints.openai.protocol_score import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from kvloom.entrypoints.openai.routers.shared import server_context
from kvloom.entrypoints.openai.serving_engine import random_id
from kvloom.entrypoints.openai.serving_pooling import OpenAIServingPooling
from kvloom.pooling.score import ScorePlan, score_pairs
from kvloom.sampling_params import PoolingParams

router = APIRouter()


class OpenAIServingScore(OpenAIServingPooling):
    async def _score(self, model: str | None, pairs: list[tuple[str, str]], truncate: int | None, param: str
                     ) -> tuple[str, list[float], int]:  # fmt: skip
        """(request id, one score per pair, prompt tokens used)."""
        try:
            plan = ScorePlan(self.config, self.require_tokenizer(param), pairs)
        except ValueError as exc:
            raise APIError(str(exc), status=HTTPStatus.BAD_REQUEST, code="unsupported_model") from None
        lora = await self.resolve_model_or_lora(model)
        self.check_num_sequences(len(plan.prompts), 1, param)
        prompts = [self._fit(p if isinstance(p, list) else (await self.tokenize_async(p, True, param)).token_ids,
                             truncate, param) for p in plan.prompts]  # fmt: skip
        request_id = random_id("score")
        pooled: list = [None] * len(prompts)
        inputs = [{"prompt_token_ids": ids} for ids in prompts]
        async for index, output in self._encode_each(request_id, inputs, PoolingParams(), lora):
            pooled[index] = output.outputs.data
        return request_id, plan.scores(pooled), sum(map(len, prompts))

    def _fit(self, ids: list[int], truncate: int | None, param: str) -> list[int]:
        if truncate is not None:
            ids = ids[-truncate:]
        if not ids:
            raise APIError(f"{param}: a text is empty (it has no tokens)", param=param)
        if len(ids) > self.max_model_len:
            raise APIError(f"{param}: a prompt is {len(ids)} tokens, more than this model's maximum context length of "
                           f"{self.max_model_len} tokens (truncate_prompt_tokens keeps the last N)", param=param,
                           code="context_length_exceeded")  # fmt: skip
        return ids

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(":", 1)[0]) from None
        request_id, scores, tokens = await self._score(request.model, pairs, request.truncate_prompt_tokens, "text_2")
        return ScoreResponse(id=request_id, model=self.models.response_name(request.model),
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))  # fmt: skip

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        pairs = [(request.query, document) for document in request.documents]
        request_id, scores, tokens = await self._score(request.model, pairs, request.truncate_prompt_tokens,
                                                       "documents")  # fmt: skip
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            ranked = ranked[: request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i]) if request.return_documents else None)
                   for i in ranked]  # fmt: skip
        return RerankResponse(id=request_id.replace("score", "rerank", 1), model=self.models.response_name(request.model),
                              usage=RerankUsage(total_tokens=tokens), results=results)  # fmt: skip


@router.post("/v1/score")
@router.post("/score")
async def create_score(raw: Request) -> Response:
    return await server_context(raw.app).serve(raw, ScoreRequest, raw.app.state.serving_score.create_score)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def create_rerank(raw: Request) -> Response:
    return await server_context(raw.app).serve(raw, RerankRequest, raw.app.state.serving_score.create_rerank)
