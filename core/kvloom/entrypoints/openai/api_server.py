"""The OpenAI-compatible HTTP server: a FastAPI app over an ``AsyncLLM``, run by uvicorn.

Endpoints: POST /v1/completions, /v1/chat/completions, /v1/embeddings, GET /v1/models,
and with ``KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1`` POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, POST /tokenize, /detokenize, /pooling (all of these run model
code and need the API key when one is set), and the open operational endpoints GET
/health, /version, /metrics. Every error is OpenAI's body
``{"error": {message, type, param, code}}``; bad input (malformed JSON, wrong types,
out-of-range values) is a 400, never FastAPI's 422.

``build_app`` assembles the app from parts of their own:

* ``request_guard.RequestGuard`` (middleware) and ``limits.ServerLimits``: no request can
  hurt the others. A body must be JSON (or carry no Content-Type; text/plain and form
  bodies, which a web page can send cross-site without a preflight, are a 415) and fit
  ``--max-request-body-bytes`` (413); large bodies are parsed off the event loop; a 500
  says "internal error" with the request id (also the ``X-Request-Id`` response header),
  the details going to the log (``error_handlers.py``);
* the endpoints, one module per endpoint or group under ``routers/``, each a
  module-level ``router`` that ``build_app`` attaches with one line
  (``<module>.attach_router(app)``; ``routers/__init__.py`` says how to add one). Their
  handlers reach the engine and the serving objects through ``request.app.state``
  (``routers.shared.ServerContext``), not closures.

The server calls ``log()`` on the engine's stat loggers every ``log_stats_interval``
seconds, and a client that disconnects cancels its engine requests (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

import kvloom
from kvloom.engine.async_llm import AsyncLLM
from kvloom.entrypoints.openai.error_handlers import install_error_handlers
from kvloom.entrypoints.openai.limits import ServerLimits
from kvloom.entrypoints.openai.request_guard import RequestGuard
from kvloom.entrypoints.openai.routers import (
    chat,
    completions,
    extra_endpoints,
    lora,
    models,
    operations,
    pooling,
    tokenization,
)
from kvloom.entrypoints.openai.routers.shared import ServerContext, server_context
from kvloom.entrypoints.openai.server_options import FrontendOptions
from kvloom.entrypoints.openai.serving_models import OpenAIServingModels
from kvloom.metrics.loggers import PrometheusStatLogger
from kvloom.utils import freeze_gc_heap

if TYPE_CHECKING:
    from kvloom.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)


def build_app(
    engine: AsyncLLM,
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
    no_docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    docs: dict[str, Any] = no_docs if frontend.disable_fastapi_docs else {}
    app = FastAPI(title="kvloom OpenAI-compatible API", version=kvloom.__version__,
                  lifespan=functools.partial(_lifespan, log_stats=log_stats), **docs)  # fmt: skip
    app.state.kvloom = ServerContext(
        engine=engine, models=OpenAIServingModels(engine), limits=limits, options=frontend, api_key=api_key
    )
    app.add_middleware(RequestGuard, max_body_bytes=limits.body_limit(engine.config.model.max_model_len))
    frontend.install_cors(app)  # outermost: preflights are answered before the guard and the API key
    install_error_handlers(app)
    # The endpoints, one router module each (after the context: they build their serving objects from it).
    completions.attach_router(app)
    chat.attach_router(app)
    pooling.attach_router(app)
    models.attach_router(app)
    lora.attach_router(app)
    tokenization.attach_router(app)
    operations.attach_router(app)
    extra_endpoints.attach_router(app)  # last: /ping, score, rerank, responses, messages, endpoint plugins
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI, log_stats: bool) -> AsyncIterator[None]:
    """While the app serves: the ``--lora-modules`` adapters loaded first (a bad one stops
    the server here), the stat loggers' ``log()`` called periodically."""
    context = server_context(app)
    await context.models.load_static_loras()
    task = None
    if log_stats:
        interval = context.engine.config.observability.log_stats_interval
        task = asyncio.create_task(_log_stats_periodically(context.engine, interval))
    try:
        yield
    finally:
        if task is not None:
            task.cancel()


async def _log_stats_periodically(engine: AsyncLLM, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for stat_logger in engine.get_stat_loggers():
            try:
                stat_logger.log()
            except Exception:
                logger.exception("Stat logger %s failed in log()", type(stat_logger).__qualname__)


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
