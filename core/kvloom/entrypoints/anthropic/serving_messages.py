"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over chat.

A request becomes a chat completion (``system`` a system message, content blocks
messages, ``tool_result`` blocks tool messages, ``tools`` function tools, ``tool_choice``
``any`` chat's ``required``, ``stop_sequences`` stop strings) run by the server's chat
serving class, so reasoning (``--reasoning-parser``: a ``thinking`` block), tool calls
(``tool_use`` blocks) and stop strings behave as on ``/v1/chat/completions``. A stream
sends Anthropic's events (``message_start``, ``content_block_start``,
``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``).
Every error, the API key's included, is Anthropic's body
``{"type": "error", "error": {"type", "message"}}``; the key may come as ``x-api-key``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from kvloom.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    chat_messages,
    chat_tools,
    error_body,
    stop_reason,
    template_kwargs,
    tool_input,
    tool_use_id,
)
from kvloom.entrypoints.openai.errors import APIError, from_validation_error, internal_error, renamed_fields
from kvloom.entrypoints.openai.protocol import ChatCompletionRequest
from kvloom.entrypoints.openai.routers.shared import server_context
from kvloom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from kvloom.entrypoints.openai.serving_engine import EventStream

logger = logging.getLogger(__name__)

#: Chat's field names in errors -> the Messages API's.
_FIELD_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


class AnthropicRoute(APIRoute):
    """A route whose errors (the API key's and the body's included) are Anthropic's body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def anthropic_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as error:
                return JSONResponse(error_body(error.status, error.message), status_code=error.status)
            except Exception:
                request_id = request.scope.get("kvloom.request_id") or "unknown"
                logger.exception("Unhandled error serving %s (request id %s)", request.url.path, request_id)
                error = internal_error(request_id)
                return JSONResponse(error_body(error.status, error.message), status_code=error.status)

        return anthropic_errors


router = APIRouter(route_class=AnthropicRoute)


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def _chat_request(self, request: CountTokensRequest, fields: dict[str, Any]) -> ChatCompletionRequest:
        try:
            body = {"model": request.model, "messages": chat_messages(request), **chat_tools(request),
                    "chat_template_kwargs": template_kwargs(request), **fields}  # fmt: skip
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(":", 1)[0]) from None
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:
            raise renamed_fields(from_validation_error(exc, ChatCompletionRequest), _FIELD_NAMES) from None

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, int]:
        self.chat.resolve_model(request.model)
        prompt = await self.chat.render(self._chat_request(request, {}))
        return {"input_tokens": len(prompt.token_ids)}

    async def create_message(self, request: MessagesRequest) -> MessageResponse | EventStream:
        fields = {"max_completion_tokens": request.max_tokens, "stop": request.stop_sequences,
                  "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
                  "min_p": request.min_p, "repetition_penalty": request.repetition_penalty, "seed": request.seed,
                  "vllm_xargs": request.vllm_xargs, "stream": request.stream,
                  "stream_options": {"include_usage": True} if request.stream else None}  # fmt: skip
        try:
            run = await self.chat.start(self._chat_request(request, fields))
        except APIError as error:
            raise renamed_fields(error, _FIELD_NAMES) from None
        message_id = f"msg_{uuid.uuid4().hex}"
        model = request.model or self.chat.model_name
        if request.stream:
            return EventStream(self._stream(run, message_id, model), run.outputs)
        completion = await self.chat.collect(run)
        (choice,) = completion.choices
        content: list[dict[str, Any]] = []
        if choice.message.reasoning:
            content.append({"type": "thinking", "thinking": choice.message.reasoning, "signature": ""})
        if choice.message.content:
            content.append({"type": "text", "text": choice.message.content})
        for call in choice.message.tool_calls or []:
            content.append({"type": "tool_use", "id": tool_use_id(), "name": call.function.name,
                            "input": tool_input(call.function.arguments)})  # fmt: skip
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
        usage = MessageUsage(input_tokens=completion.usage.prompt_tokens,
                             output_tokens=completion.usage.completion_tokens)  # fmt: skip
        return MessageResponse(id=message_id, model=model, content=content, stop_reason=reason, stop_sequence=sequence,
                               usage=usage)  # fmt: skip

    async def _stream(self, run: ChatRun, message_id: str, model: str) -> AsyncIterator[str]:
        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

        message = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(run.prompt.token_ids), "output_tokens": 0}}  # fmt: skip
        yield event("message_start", message=message)
        index = -1  # the open block's index
        open_kind: str | None = None
        calls: dict[int, int] = {}  # a chat tool call's index -> its block
        finish: tuple[str | None, str | None] = (None, None)
        output_tokens = 0
        try:
            async for chunk in self.chat.stream_chunks(run):
                if chunk.usage is not None:
                    output_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    delta = choice.delta
                    pieces: list[tuple[str, Any]] = []
                    if delta.reasoning:
                        pieces.append(("thinking", delta.reasoning))
                    if delta.content:
                        pieces.append(("text", delta.content))
                    pieces.extend(("tool_use", call) for call in delta.tool_calls or [])
                    for kind, value in pieces:
                        if kind == "tool_use" and value.index in calls:
                            piece = {"type": "input_json_delta", "partial_json": value.function.arguments or ""}
                            yield event("content_block_delta", index=calls[value.index], delta=piece)
                            continue
                        if kind != open_kind or kind == "tool_use":
                            if open_kind is not None:
                                yield event("content_block_stop", index=index)
                            index, open_kind = index + 1, kind
                            yield event("content_block_start", index=index, content_block=_block_start(kind, value))
                            if kind == "tool_use":
                                calls[value.index] = index
                        yield event("content_block_delta", index=index, delta=_block_delta(kind, value))
                    if choice.finish_reason is not None:
                        finish = stop_reason(choice.finish_reason, choice.stop_reason)
            if open_kind is not None:
                yield event("content_block_stop", index=index)
        except APIError as error:
            yield event("error", error=error_body(error.status, error.message)["error"])
            return
        except Exception:
            logger.exception("Streaming message %s failed", message_id)
            error = internal_error(message_id)
            yield event("error", error=error_body(error.status, error.message)["error"])
            return
        yield event("message_delta", delta={"stop_reason": finish[0], "stop_sequence": finish[1]},
                    usage={"output_tokens": output_tokens})  # fmt: skip
        yield event("message_stop")


def _block_start(kind: str, value: Any) -> dict[str, Any]:
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if kind == "text":
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": tool_use_id(), "name": value.function.name, "input": {}}


def _block_delta(kind: str, value: Any) -> dict[str, Any]:
    if kind == "thinking":
        return {"type": "thinking_delta", "thinking": value}
    if kind == "text":
        return {"type": "text_delta", "text": value}
    return {"type": "input_json_delta", "partial_json": value.function.arguments or ""}


@router.post("/v1/messages")
async def create_message(raw: Request) -> Response:
    return await server_context(raw.app).serve(raw, MessagesRequest, raw.app.state.serving_messages.create_message)


@router.post("/v1/messages/count_tokens")
async def count_tokens(raw: Request) -> Response:
    request = await server_context(raw.app).read_body(raw, CountTokensRequest)
    return JSONResponse(await raw.app.state.serving_messages.count_tokens(request))
