"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from kvloom.entrypoints.openai.protocol import CompletionRequest
from kvloom.entrypoints.openai.routers.shared import answer, read_body, require_api_key, server_context
from kvloom.entrypoints.openai.serving_completion import OpenAIServingCompletion

router = APIRouter(dependencies=[Depends(require_api_key)])


def attach_router(app: FastAPI) -> None:
    context = server_context(app)
    serving = OpenAIServingCompletion(context.engine, context.models, context.limits)
    serving.log_requests = context.options.enable_log_requests
    app.state.serving_completion = serving
    app.include_router(router)


def _serving(request: Request) -> OpenAIServingCompletion:
    return request.app.state.serving_completion


@router.post("/v1/completions")
async def create_completion(raw: Request) -> Response:
    request = await read_body(raw, CompletionRequest)
    return await answer(raw, _serving(raw).create_completion(request))
