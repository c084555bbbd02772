"""What every router shares: the server's context, the API-key check, reading a body
under the request limits, and answering a request until its client disconnects.

``build_app`` puts one ``ServerContext`` on ``app.state.kvloom`` before it attaches the
routers; a router's ``attach_router(app)`` builds its serving object from it, and its
handlers find both through ``request.app.state``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from kvloom.entrypoints.openai.errors import APIError, parse_json_body, validate_body
from kvloom.entrypoints.openai.limits import ServerLimits, run_blocking
from kvloom.entrypoints.openai.server_options import FrontendOptions

if TYPE_CHECKING:
    from kvloom.engine.async_llm import AsyncLLM
    from kvloom.entrypoints.openai.serving_models import OpenAIServingModels

T = TypeVar("T")

#: Status for a request whose client went away before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class ServerContext:
    """What every router, and every endpoint plugin, may use (``app.state.kvloom``)."""

    engine: AsyncLLM
    """The engine (``generate``, ``encode``, ``tokenizer``, ``config``)."""
    models: OpenAIServingModels
    """The served model and its LoRA adapters (every endpoint resolves ``model`` here)."""
    limits: ServerLimits
    """What one request may ask (``--max-sequences-per-request``, ...)."""
    options: FrontendOptions
    """The front-end flags (response role, tool-call parser, ...)."""
    api_key: str | None
    """With a key, the endpoints that run model code need it (``require_api_key``)."""

    async def read_body(self, request: Request, model: type[T]) -> T:
        """The JSON body validated as the pydantic ``model`` (limits applied; a 400 naming the field)."""
        return await read_body(request, model)

    async def read_json(self, request: Request) -> Any:
        """The JSON body, limits applied."""
        return await read_json(request)

    async def respond(self, request: Request, work: Awaitable[Any]) -> Response:
        """``await``s ``work`` unless the client goes away (then its engine requests are
        aborted): a response model as JSON, an async iterator of strings as server-sent events."""
        return await answer(request, work)

    async def serve(self, request: Request, model: type[T], handler: Callable[[T], Awaitable[Any]]) -> Response:
        """The body validated as ``model``, given to ``handler``, its result answered (``respond``)."""
        return await answer(request, handler(await read_body(request, model)))


def server_context(app: FastAPI) -> ServerContext:
    return app.state.kvloom


async def require_api_key(request: Request) -> None:
    """The dependency of every router whose endpoints run model code: a 401 unless the
    request carries the key as ``Authorization: Bearer KEY`` (OpenAI's clients) or
    ``x-api-key: KEY`` (Anthropic's); nothing to check without a key."""
    api_key = server_context(request.app).api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(given.encode(), api_key.encode()):
        raise APIError("Invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                       status=HTTPStatus.UNAUTHORIZED, code="invalid_api_key")  # fmt: skip


async def read_json(request: Request) -> Any:
    """The body as JSON (parsed off the event loop when it is large)."""
    limits = server_context(request.app).limits
    body = await request.body()
    return await run_blocking(len(body), parse_json_body, body, limits.max_json_depth, limits.max_json_number_length)


async def read_body(request: Request, model: type[T]) -> T:
    """The body validated as ``model`` (parsed and validated off the event loop when large)."""
    limits = server_context(request.app).limits
    body = await request.body()
    return await run_blocking(len(body), lambda: validate_body(model, parse_json_body(
        body, limits.max_json_depth, limits.max_json_number_length)))  # fmt: skip


async def answer(request: Request, work: Awaitable[Any]) -> Response:
    """``work``'s result as the response (``respond``), unless the client disconnects
    first: then the work is cancelled (which aborts its engine requests) and the status
    is ``CLIENT_CLOSED_REQUEST``."""
    result = await run_until_disconnected(request, work)
    return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else await respond(result)


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts
    its engine requests) and return None."""
    work_task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(wait_for_disconnect())
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        watcher.cancel()
        work_task.cancel()
        raise
    watcher.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work_task
    return None


class ClosingStreamingResponse(StreamingResponse):
    """A stream whose iterator is closed however the response ends (finished, the client
    gone before or while it streams, an error), which aborts its engine requests at once."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def respond(result: Any) -> Response:
    """A stream as server-sent events, else the response as JSON: serialized off the event
    loop when it is large (n x max_tokens x logprobs can make megabytes)."""
    if isinstance(result, AsyncIterator):
        return ClosingStreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    usage = getattr(result, "usage", None)
    size = (usage.total_tokens if usage is not None else 0) * 64 + 64 * len(getattr(result, "data", ()) or ())
    return Response(await run_blocking(size, result.model_dump_json), media_type="application/json")
