"""The OpenAI-compatible HTTP server: a FastAPI app over an ``AsyncLLM``, run by uvicorn.

Endpoints: POST /v1/completions, /v1/chat/completions, /v1/embeddings, GET /v1/models,
and with ``KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1`` POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (all under /v1 need the API key when one is set), GET /health,
/version, /metrics, POST /tokenize, /detokenize, /pooling. Every error is OpenAI's body
``{"error": {message, type, param, code}}``; bad input (malformed JSON, wrong types,
out-of-range values) is a 400, never FastAPI's 422.

The server calls ``log()`` on the engine's stat loggers every ``log_stats_interval``
seconds, and a client that disconnects cancels its engine requests (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

import prometheus_client
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvloom
from kvloom.engine.async_llm import AsyncLLM
from kvloom.entrypoints.openai.errors import (
    APIError,
    from_validation_errors,
    parse_json_body,
    validate_body,
)
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    IOProcessorRequest,
    LoadLoRAAdapterRequest,
    PoolingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
)
from kvloom.entrypoints.openai.serving_chat import OpenAIServingChat
from kvloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvloom.entrypoints.openai.serving_models import (
    OpenAIServingModels,
    runtime_lora_updating_allowed,
)
from kvloom.entrypoints.openai.serving_pooling import OpenAIServingPooling
from kvloom.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvloom.metrics.loggers import PrometheusStatLogger
from kvloom.pooling.io_processors import load_io_processor

if TYPE_CHECKING:
    from kvloom.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Status for a request whose client went away before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


def error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == HTTPStatus.UNAUTHORIZED else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


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


def _respond(result: Any) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump(mode="json"))


def metrics_text(engine: "AsyncLLM") -> bytes:
    """The Prometheus exposition: the engine's metrics, then the process/python ones."""
    parts = [
        prometheus_client.generate_latest(stat_logger.registry)
        for stat_logger in engine.get_stat_loggers()
        if isinstance(stat_logger, PrometheusStatLogger)
    ]
    parts.append(prometheus_client.generate_latest(prometheus_client.REGISTRY))
    return b"".join(parts)


async def _log_stats_periodically(engine: "AsyncLLM", interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for stat_logger in engine.get_stat_loggers():
            try:
                stat_logger.log()
            except Exception:
                logger.exception("Stat logger %s failed in log()", type(stat_logger).__qualname__)


def build_app(engine: "AsyncLLM", api_key: str | None = None, log_stats: bool = True) -> FastAPI:
    """The FastAPI app serving ``engine``. With ``api_key``, /v1/* needs
    ``Authorization: Bearer <api_key>``."""

    models = OpenAIServingModels(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await models.load_static_loras()  # a bad --lora-modules adapter stops the server here
        task = None
        if log_stats:
            interval = engine.config.observability.log_stats_interval
            task = asyncio.create_task(_log_stats_periodically(engine, interval))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    app = FastAPI(title="kvloom OpenAI-compatible API", version=kvloom.__version__, lifespan=lifespan)
    app.state.engine = engine

    completions = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models)
    tokenization = OpenAIServingTokenization(engine, models)
    pooling = OpenAIServingPooling(engine, models, load_io_processor(engine.config))

    # ---------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error serving %s %s", request.method, request.url.path)
        return error_response(APIError(f"Internal server error: {type(exc).__name__}: {exc}",
                                       status=HTTPStatus.INTERNAL_SERVER_ERROR))  # fmt: skip

    # ---------------------------------------------------------------- /v1 (API key)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError("Invalid or missing API key (send 'Authorization: Bearer <key>')",
                           status=HTTPStatus.UNAUTHORIZED, code="invalid_api_key")  # fmt: skip

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/completions")
    async def create_completion(raw: Request) -> Response:
        request = validate_body(CompletionRequest, parse_json_body(await raw.body()))
        result = await run_until_disconnected(raw, completions.create_completion(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else _respond(result)

    @v1.post("/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        request = validate_body(ChatCompletionRequest, parse_json_body(await raw.body()))
        result = await run_until_disconnected(raw, chat.create_chat_completion(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else _respond(result)

    @v1.post("/embeddings")
    async def create_embedding(raw: Request) -> Response:
        request = validate_body(EmbeddingRequest, parse_json_body(await raw.body()))
        result = await run_until_disconnected(raw, pooling.create_embedding(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else _respond(result)

    @v1.get("/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.model_list().model_dump(mode="json"))

    if runtime_lora_updating_allowed():
        logger.warning("Runtime LoRA updating is on (KVLOOM_ALLOW_RUNTIME_LORA_UPDATING): clients may load "
                       "adapters from this machine's files")  # fmt: skip

        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(raw: Request) -> Response:
            request = validate_body(LoadLoRAAdapterRequest, parse_json_body(await raw.body()))
            await models.load_lora_adapter(request.lora_name, request.lora_path)
            return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain")

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request) -> Response:
            request = validate_body(UnloadLoRAAdapterRequest, parse_json_body(await raw.body()))
            await models.unload_lora_adapter(request.lora_name)
            return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.",
                            media_type="text/plain")  # fmt: skip

    app.include_router(v1)

    # ---------------------------------------------------------------- operations

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:
            logger.error("Health check failed: %s", exc)
            return error_response(APIError(f"Engine is not healthy: {exc}", status=HTTPStatus.SERVICE_UNAVAILABLE))
        return Response(status_code=HTTPStatus.OK)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvloom.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text(engine), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        data = parse_json_body(await raw.body())
        model = TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest
        response = tokenization.tokenize_request(validate_body(model, data))
        return JSONResponse(response.model_dump(mode="json"))

    @app.post("/pooling")
    async def create_pooling(raw: Request) -> Response:
        data = parse_json_body(await raw.body())
        if isinstance(data, dict) and "data" in data:
            work: Awaitable[Any] = pooling.create_io_processor_pooling(validate_body(IOProcessorRequest, data))
        else:
            work = pooling.create_pooling(validate_body(PoolingRequest, data))
        result = await run_until_disconnected(raw, work)
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else _respond(result)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        request = validate_body(DetokenizeRequest, parse_json_body(await raw.body()))
        return JSONResponse(tokenization.detokenize_request(request).model_dump(mode="json"))

    return app


#: After the engine core died: how long open responses get to send their errors before the
#: server stops, and how long it then waits for connections before it closes them.
ENGINE_DEATH_GRACE_S = 1.0
ENGINE_DEATH_FORCE_EXIT_S = 5.0


async def serve_http(
    engine_args: "EngineArgs",
    host: str = "0.0.0.0",
    port: int = 8000,
    api_key: str | None = None,
    uvicorn_log_level: str = "info",
    access_log: bool = True,
) -> int:
    """Start the engine (with a PrometheusStatLogger), then serve until SIGINT/SIGTERM.

    Returns the exit status: 0 after a shutdown by signal; 1 when the engine core died
    (every open request got the error, /health answers 503, and the server stops by
    itself shortly after, so that a supervisor restarts it). The engine core process is
    stopped either way."""
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[PrometheusStatLogger])
    engine_error: list[BaseException] = []
    try:
        app = build_app(engine, api_key=api_key)
        config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level, access_log=access_log)
        server = uvicorn.Server(config)
        loop = asyncio.get_running_loop()

        def stop() -> None:
            server.should_exit = True
            loop.call_later(ENGINE_DEATH_FORCE_EXIT_S, setattr, server, "force_exit", True)

        def on_engine_dead(error: BaseException) -> None:
            engine_error.append(error)
            logger.critical("The engine core died (%s); kvloom serve is shutting down (exit status 1)", error)
            loop.call_later(ENGINE_DEATH_GRACE_S, stop)

        engine.on_engine_dead(on_engine_dead)
        logger.info("kvloom %s serving %s on http://%s:%d", kvloom.__version__,
                    engine.config.model.served_model_name, host, port)  # fmt: skip
        await server.serve()
    finally:
        engine.shutdown()
    return 1 if engine_error else 0
