"""What the server's endpoint routers share, in ``app.state.kvloom``: the engine, the
served models, the request limits and front-end options, the API key check, and the
server's way to read a body and answer a request. The first-party routers (``/ping``,
score and rerank, ``/v1/responses``, ``/v1/messages``) and endpoint plugins reach it
through ``request.app.state.kvloom``."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from kvloom.entrypoints.openai.errors import APIError

if TYPE_CHECKING:
    from kvloom.engine.async_llm import AsyncLLM
    from kvloom.entrypoints.openai.frontend import FrontendOptions
    from kvloom.entrypoints.openai.limits import ServerLimits
    from kvloom.entrypoints.openai.serving_chat import OpenAIServingChat
    from kvloom.entrypoints.openai.serving_models import OpenAIServingModels

T = TypeVar("T")


def check_api_key(api_key: str | None, request: Request) -> None:
    """A 401 unless the request carries ``api_key`` as ``Authorization: Bearer KEY`` (OpenAI's
    clients) or ``x-api-key: KEY`` (Anthropic's); nothing to check without a key."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(given.encode(), api_key.encode()):
        raise APIError("Invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                       status=HTTPStatus.UNAUTHORIZED, code="invalid_api_key")  # fmt: skip


@dataclass
class ServerContext:
    """The server's shared state, for its routers (``request.app.state.kvloom``)."""

    engine: "AsyncLLM"
    """The engine (``generate``, ``encode``, ``tokenizer``, ``config``)."""
    models: "OpenAIServingModels"
    """The served model and its LoRA adapters."""
    limits: "ServerLimits"
    """What one request may ask (``--max-sequences-per-request``, ...)."""
    frontend: "FrontendOptions"
    """The front-end flags (response role, tool-call parser, ...)."""
    api_key: str | None
    """``--api-key`` (None: no key)."""
    chat: "OpenAIServingChat"
    """The server's chat completions (its tool-call and reasoning parsers)."""
    read_body: Callable[[Request, type[Any]], Awaitable[Any]]
    """``await read_body(request, Model)``: the JSON body validated as the pydantic
    ``Model`` (size, depth and number limits applied; a 400 naming the field)."""
    read_json: Callable[[Request], Awaitable[Any]]
    """``await read_json(request)``: the JSON body, limits applied."""
    respond: Callable[[Request, Awaitable[Any]], Awaitable[Response]]
    """``await respond(request, work)``: awaits ``work`` unless the client goes away (then
    its engine requests are aborted); a response model as JSON, an async iterator of
    strings as server-sent events."""

    async def serve(self, request: Request, model: type[T], handler: Callable[[T], Awaitable[Any]]) -> Response:
        """The body validated as ``model``, given to ``handler``, its result answered (``respond``)."""
        body = await self.read_body(request, model)
        return await self.respond(request, handler(body))


def server_context(request: Request) -> ServerContext:
    """The ``ServerContext`` of the app serving ``request``."""
    return request.app.state.kvloom


async def require_api_key(request: Request) -> None:
    """The FastAPI dependency of every route that runs model code."""
    check_api_key(server_context(request).api_key, request)
