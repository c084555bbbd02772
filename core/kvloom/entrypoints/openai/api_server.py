"""The OpenAI-compatible HTTP server: a FastAPI app over an ``AsyncLLM``, run by uvicorn.

Endpoints: POST /v1/completions, /v1/chat/completions, /v1/embeddings, GET /v1/models,
and with ``KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1`` POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, POST /tokenize, /detokenize, /pooling (all of these run model
code and need the API key when one is set), and the open operational endpoints GET
/health, /version, /metrics; ``extra_endpoints`` attaches the rest (/ping, score and
rerank, /v1/responses, /v1/messages, endpoint plugins). Every error is OpenAI's body
``{"error": {message, type, param, code}}``; bad input (malformed JSON, wrong types,
out-of-range values) is a 400, never FastAPI's 422.

No request can hurt the others (``RequestGuard``, ``limits.ServerLimits``): a body must be
JSON (or carry no Content-Type; text/plain and form bodies, which a web page can send
cross-site without a preflight, are a 415) and fit ``--max-request-body-bytes`` (413);
large bodies are parsed off the event loop; a 500 says "internal error" with the request
id (also the ``X-Request-Id`` response header), the details going to the log.

The server calls ``log()`` on the engine's stat loggers every ``log_stats_interval``
seconds, and a client that disconnects cancels its engine requests (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

import prometheus_client
import prometheus_client.multiprocess
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvloom
from kvloom.engine.async_llm import AsyncLLM
from kvloom.entrypoints.anthropic.protocol import ANTHROPIC_PATH
from kvloom.entrypoints.anthropic.protocol import error_body as anthropic_error_body
from kvloom.entrypoints.openai.errors import (
    APIError,
    from_validation_errors,
    internal_error,
    parse_json_body,
    validate_body,
)
from kvloom.entrypoints.openai.extra_endpoints import attach_endpoints
from kvloom.entrypoints.openai.frontend import FrontendOptions
from kvloom.entrypoints.openai.limits import ServerLimits, run_blocking
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
from kvloom.entrypoints.openai.ping import health_response
from kvloom.entrypoints.openai.server_context import ServerContext
from kvloom.entrypoints.openai.server_context import check_api_key as check_key
from kvloom.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvloom.metrics.loggers import PrometheusStatLogger, multiprocess_metrics_dir
from kvloom.pooling.io_processors import load_io_processor
from kvloom.tool_parsers.registry import get_tool_parser_cls
from kvloom.utils import freeze_gc_heap

if TYPE_CHECKING:
    from kvloom.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Status for a request whose client went away before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """``error`` in OpenAI's body, or in Anthropic's on Anthropic's API (``path``)."""
    headers = {"WWW-Authenticate": "Bearer"} if error.status == HTTPStatus.UNAUTHORIZED else None
    body = anthropic_error_body(error.status, error.message) if path.startswith(ANTHROPIC_PATH) else error.body()
    return JSONResponse(body, status_code=error.status, headers=headers)


#: Media types a request body may have: JSON, or none said.
_JSON_MEDIA_TYPES = ("application/json",)
_REQUEST_ID_HEADER = b"x-request-id"


def request_id_of(request: Request) -> str:
    return request.scope.get("kvloom.request_id") or "unknown"


class RequestGuard:
    """ASGI middleware in front of every route.

    * Gives each HTTP request an id (a sane ``X-Request-Id`` header of the client's, else
      a new one), in ``scope["kvloom.request_id"]`` and the response's ``X-Request-Id``.
    * A request with a body must be JSON: a Content-Type other than ``application/json``
      (or ``*+json``) is refused with 415 before the body is read, in particular the
      CORS-safelisted text/plain, application/x-www-form-urlencoded and
      multipart/form-data that a web page can send to a local server without a preflight.
      A missing Content-Type is accepted (curl, simple clients).
    * A body larger than ``max_body_bytes`` is refused with 413: at once by its
      Content-Length, or as soon as a chunked body passes the limit (the route's read of
      the body raises ``APIError(413)``).
    """

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        request_id = _sane_request_id(headers.get(_REQUEST_ID_HEADER)) or f"req-{uuid.uuid4().hex}"
        scope["kvloom.request_id"] = request_id

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (_REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        problem = self._refuse(scope["method"], headers)
        if problem is not None:
            await error_response(problem, scope.get("path", ""))(scope, receive, send_with_id)
            return
        limit, received = self.max_body_bytes, 0

        async def receive_limited() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit)
            return message

        started = False

        async def send_tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_with_id(message)

        try:
            await self.app(scope, receive_limited, send_tracked)
        except Exception as exc:  # no handler took it: log it, answer "internal error" with the id
            logger.error("Unhandled error serving %s %s (request id %s)", scope["method"], scope.get("path"),
                         request_id, exc_info=exc)  # fmt: skip
            if started:
                raise  # too late for a response of ours; the server closes the connection
            await error_response(internal_error(request_id), scope.get("path", ""))(scope, receive, send_with_id)

    def _refuse(self, method: str, headers: dict[bytes, bytes]) -> APIError | None:
        if method not in ("POST", "PUT", "PATCH"):
            return None
        content_type = headers.get(b"content-type")
        if content_type is not None:
            media_type = content_type.decode("latin-1").split(";", 1)[0].strip().lower()
            if media_type not in _JSON_MEDIA_TYPES and not media_type.endswith("+json"):
                return APIError(f"Unsupported Content-Type {media_type[:100]!r}: request bodies must be JSON "
                                "(Content-Type: application/json)", status=HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                                code="unsupported_media_type")  # fmt: skip
        length = headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return APIError("Content-Length is not a number", code="invalid_request")
            if size > self.max_body_bytes:
                return _too_large(self.max_body_bytes)
        return None


def _too_large(limit: int) -> APIError:
    return APIError(f"Request body too large: this server accepts at most {limit} bytes "
                    "(--max-request-body-bytes)", status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    code="request_too_large")  # fmt: skip


def _sane_request_id(value: bytes | None) -> str | None:
    if value is None or not 0 < len(value) <= 128:
        return None
    text = value.decode("latin-1")
    return text if all(c.isalnum() or c in "-_.:" for c in text) else None


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


class _ClosingStreamingResponse(StreamingResponse):
    """A stream whose iterator is closed however the response ends (finished, the client
    gone before or while it streams, an error), which aborts its engine requests at once."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _respond(result: Any) -> Response:
    """A stream as server-sent events, else the response as JSON: serialized off the event
    loop when it is large (n x max_tokens x logprobs can make megabytes)."""
    if isinstance(result, AsyncIterator):
        return _ClosingStreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    usage = getattr(result, "usage", None)
    size = (usage.total_tokens if usage is not None else 0) * 64 + 64 * len(getattr(result, "data", ()) or ())
    return Response(await run_blocking(size, result.model_dump_json), media_type="application/json")


def metrics_text(engine: "AsyncLLM") -> bytes:
    """The Prometheus exposition: the engine's metrics, then the process/python ones. With
    several API servers (``PROMETHEUS_MULTIPROC_DIR`` set by the launcher), the metrics of
    all of them, summed (gauges of the engine: the most recent value), whichever answers;
    the process/python metrics of one process are left out then (as in vLLM)."""
    if multiprocess_metrics_dir() is not None:
        registry = prometheus_client.CollectorRegistry()
        prometheus_client.multiprocess.MultiProcessCollector(registry)
        return prometheus_client.generate_latest(registry)
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


def build_app(
    engine: "AsyncLLM",
    api_key: str | None = None,
    log_stats: bool = True,
    limits: ServerLimits | None = None,
    frontend: FrontendOptions | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``. With ``api_key``, every endpoint that runs model
    code (/v1/*, /tokenize, /detokenize, /pooling) needs ``Authorization: Bearer
    <api_key>``; /health, /version and /metrics stay open (as in vLLM). ``limits``: what one
    request may ask (``ServerLimits``; the defaults when None). ``frontend``: response
    role, request logging, CORS, docs pages (``FrontendOptions``)."""

    limits = limits if limits is not None else ServerLimits()
    frontend = frontend if frontend is not None else FrontendOptions()
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

    no_docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    docs: dict[str, Any] = no_docs if frontend.disable_fastapi_docs else {}
    app = FastAPI(title="kvloom OpenAI-compatible API", version=kvloom.__version__, lifespan=lifespan, **docs)
    app.state.engine = engine
    app.add_middleware(RequestGuard, max_body_bytes=limits.body_limit(engine.config.model.max_model_len))
    frontend.install_cors(app)  # outermost: preflights are answered before the guard and the API key

    completions = OpenAIServingCompletion(engine, models, limits)
    chat = OpenAIServingChat(engine, models, limits)
    chat.response_role = frontend.response_role
    if frontend.enable_auto_tool_choice and frontend.tool_call_parser is not None:
        chat.tool_parser_cls = get_tool_parser_cls(frontend.tool_call_parser)
    completions.log_requests = chat.log_requests = frontend.enable_log_requests
    tokenization = OpenAIServingTokenization(engine, models, limits)
    pooling = OpenAIServingPooling(engine, models, load_io_processor(engine.config), limits)

    async def read_json(raw: Request) -> Any:
        """The body as JSON (parsed off the event loop when it is large)."""
        body = await raw.body()
        return await run_blocking(len(body), parse_json_body, body, limits.max_json_depth,
                                  limits.max_json_number_length)  # fmt: skip

    async def read_body(raw: Request, model: type[T]) -> T:
        """The body validated as ``model`` (parsed and validated off the event loop when large)."""
        body = await raw.body()
        return await run_blocking(len(body), lambda: validate_body(model, parse_json_body(
            body, limits.max_json_depth, limits.max_json_number_length)))  # fmt: skip

    # ---------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_errors(exc.errors()), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(str(exc.detail), status=exc.status_code), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request_id_of(request)
        logger.error("Unhandled error serving %s %s (request id %s)", request.method, request.url.path, request_id,
                     exc_info=exc)  # fmt: skip
        return error_response(internal_error(request_id), request.url.path)

    # ---------------------------------------------------------------- /v1 (API key)

    async def check_api_key(request: Request) -> None:
        check_key(api_key, request)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    # The endpoints outside /v1 that run model code (vLLM's paths) need the key as well.
    model_ops = APIRouter(dependencies=[Depends(check_api_key)])

    @v1.post("/completions")
    async def create_completion(raw: Request) -> Response:
        request = await read_body(raw, CompletionRequest)
        result = await run_until_disconnected(raw, completions.create_completion(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else await _respond(result)

    @v1.post("/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        request = await read_body(raw, ChatCompletionRequest)
        result = await run_until_disconnected(raw, chat.create_chat_completion(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else await _respond(result)

    @v1.post("/embeddings")
    async def create_embedding(raw: Request) -> Response:
        request = await read_body(raw, EmbeddingRequest)
        result = await run_until_disconnected(raw, pooling.create_embedding(request))
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else await _respond(result)

    @v1.get("/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.model_list().model_dump(mode="json"))

    if runtime_lora_updating_allowed():
        logger.warning("Runtime LoRA updating is on (KVLOOM_ALLOW_RUNTIME_LORA_UPDATING): clients may load "
                       "adapters from this machine's files")  # fmt: skip

        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(raw: Request) -> Response:
            request = await read_body(raw, LoadLoRAAdapterRequest)
            await models.load_lora_adapter(request.lora_name, request.lora_path)
            return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain")

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request) -> Response:
            request = await read_body(raw, UnloadLoRAAdapterRequest)
            await models.unload_lora_adapter(request.lora_name)
            return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.",
                            media_type="text/plain")  # fmt: skip

    app.include_router(v1)

    # ---------------------------------------------------------------- operations

    @app.get("/health")
    async def health() -> Response:
        return await health_response(engine)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvloom.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text(engine), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @model_ops.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        data = await read_json(raw)
        model = TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest
        response = await tokenization.tokenize_request(validate_body(model, data))
        body = await run_blocking(8 * response.count, response.model_dump_json)  # a long prompt: megabytes
        return Response(body, media_type="application/json")

    @model_ops.post("/pooling")
    async def create_pooling(raw: Request) -> Response:
        data = await read_json(raw)
        if isinstance(data, dict) and "data" in data:
            work: Awaitable[Any] = pooling.create_io_processor_pooling(validate_body(IOProcessorRequest, data))
        else:
            work = pooling.create_pooling(validate_body(PoolingRequest, data))
        result = await run_until_disconnected(raw, work)
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else await _respond(result)

    @model_ops.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        request = await read_body(raw, DetokenizeRequest)
        response = await tokenization.detokenize_request(request)
        return Response(await run_blocking(len(response.prompt), response.model_dump_json), media_type="application/json")

    app.include_router(model_ops)

    async def respond(raw: Request, work: Awaitable[Any]) -> Response:
        result = await run_until_disconnected(raw, work)
        return Response(status_code=CLIENT_CLOSED_REQUEST) if result is None else await _respond(result)

    # /ping, score and rerank, /v1/responses, /v1/messages, endpoint plugins (extra_endpoints).
    attach_endpoints(app, ServerContext(engine, models, limits, frontend, api_key, chat, read_body, read_json, respond))
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
    limits: ServerLimits | None = None,
    frontend: FrontendOptions | None = None,
) -> int:
    """Start the engine (with a PrometheusStatLogger), then serve until SIGINT/SIGTERM.

    Returns the exit status: 0 after a shutdown by signal; 1 when the engine core died
    (every open request got the error, /health answers 503, and the server stops by
    itself shortly after, so that a supervisor restarts it). The engine core process is
    stopped either way."""
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[PrometheusStatLogger])
    try:
        frontend = frontend if frontend is not None else FrontendOptions()
        config = uvicorn.Config(build_app(engine, api_key=api_key, limits=limits, frontend=frontend), host=host,
                                port=port, log_level=uvicorn_log_level, access_log=access_log,
                                **frontend.uvicorn_kwargs())  # fmt: skip
        engines = engine.config.parallel.data_parallel_size
        scheme = "https" if frontend.ssl_certfile else "http"
        logger.info("kvloom %s serving %s on %s://%s:%d with 1 API server and %d engine core%s", kvloom.__version__,
                    engine.config.model.served_model_name, scheme, host, port, engines,
                    "s" if engines > 1 else "")  # fmt: skip
        return await serve_engine(engine, config)
    finally:
        engine.shutdown()


async def serve_engine(engine: AsyncLLM, config: uvicorn.Config, sock: socket.socket | None = None) -> int:
    """Serve ``config.app`` (built over ``engine``) until uvicorn stops: on SIGINT/SIGTERM
    (exit status 0), or shortly after the engine core died (1). ``sock``: a listening
    socket to serve on (one the API servers of ``kvloom serve --api-server-count`` share)
    instead of binding ``config.host:config.port``. The caller shuts the engine down."""
    engine_error: list[BaseException] = []
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
    # The app, the tokenizer and the engine client are built: keep them out of the cyclic
    # GC's full collections, which the per-token allocations of many streams trigger (as the
    # engine core process does, kvloom.utils.freeze_gc_heap).
    freeze_gc_heap()
    await server.serve(sockets=None if sock is None else [sock])
    return 1 if engine_error else 0
