"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from kvloom.entrypoints.openai.protocol import ChatCompletionRequest
from kvloom.entrypoints.openai.routers.shared import answer, read_body, require_api_key, server_context
from kvloom.entrypoints.openai.serving_chat import OpenAIServingChat
from kvloom.tool_parsers.registry import get_tool_parser_cls

router = APIRouter(dependencies=[Depends(require_api_key)])


def attach_router(app: FastAPI) -> None:
    context = server_context(app)
    options = context.options
    serving = OpenAIServingChat(context.engine, context.models, context.limits)
    serving.response_role = options.response_role
    if options.enable_auto_tool_choice and options.tool_call_parser is not None:
        serving.tool_parser_cls = get_tool_parser_cls(options.tool_call_parser)
    serving.log_requests = options.enable_log_requests
    app.state.serving_chat = serving
    app.include_router(router)


def _serving(request: Request) -> OpenAIServingChat:
    return request.app.state.serving_chat


@router.post("/v1/chat/completions")
async def create_chat_completion(raw: Request) -> Response:
    request = await read_body(raw, ChatCompletionRequest)
    return await answer(raw, _serving(raw).create_chat_completion(request))
