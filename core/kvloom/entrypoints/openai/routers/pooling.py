"""Pooling models: POST /v1/embeddings (OpenAI's) and /pooling (vLLM's; with an IO
processor plugin, its own input and output)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from kvloom.entrypoints.openai.errors import validate_body
from kvloom.entrypoints.openai.protocol import EmbeddingRequest, IOProcessorRequest, PoolingRequest
from kvloom.entrypoints.openai.routers.shared import answer, read_body, read_json, require_api_key, server_context
from kvloom.entrypoints.openai.serving_pooling import OpenAIServingPooling
from kvloom.pooling.io_processors import load_io_processor

router = APIRouter(dependencies=[Depends(require_api_key)])


def attach_router(app: FastAPI) -> None:
    context = server_context(app)
    io_processor = load_io_processor(context.engine.config)
    app.state.serving_pooling = OpenAIServingPooling(context.engine, context.models, io_processor, context.limits)
    app.include_router(router)


def _serving(request: Request) -> OpenAIServingPooling:
    return request.app.state.serving_pooling


@router.post("/v1/embeddings")
async def create_embedding(raw: Request) -> Response:
    request = await read_body(raw, EmbeddingRequest)
    return await answer(raw, _serving(raw).create_embedding(request))


@router.post("/pooling")
async def create_pooling(raw: Request) -> Response:
    data = await read_json(raw)
    pooling = _serving(raw)
    if isinstance(data, dict) and "data" in data:
        work: Awaitable[Any] = pooling.create_io_processor_pooling(validate_body(IOProcessorRequest, data))
    else:
        work = pooling.create_pooling(validate_body(PoolingRequest, data))
    return await answer(raw, work)
