"""POST /tokenize and /detokenize (vLLM's paths, outside /v1; they need the API key too)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from kvloom.entrypoints.openai.errors import validate_body
from kvloom.entrypoints.openai.limits import run_blocking
from kvloom.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from kvloom.entrypoints.openai.routers.shared import read_body, read_json, require_api_key, server_context
from kvloom.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

router = APIRouter(dependencies=[Depends(require_api_key)])


def attach_router(app: FastAPI) -> None:
    context = server_context(app)
    app.state.serving_tokenization = OpenAIServingTokenization(context.engine, context.models, context.limits)
    app.include_router(router)


def _serving(request: Request) -> OpenAIServingTokenization:
    return request.app.state.serving_tokenization


@router.post("/tokenize")
async def tokenize(raw: Request) -> Response:
    data = await read_json(raw)
    model = TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest
    response = await _serving(raw).tokenize_request(validate_body(model, data))
    body = await run_blocking(8 * response.count, response.model_dump_json)  # a long prompt: megabytes
    return Response(body, media_type="application/json")


@router.post("/detokenize")
async def detokenize(raw: Request) -> Response:
    request = await read_body(raw, DetokenizeRequest)
    response = await _serving(raw).detokenize_request(request)
    return Response(await run_blocking(len(response.prompt), response.model_dump_json), media_type="application/json")
