"""The router's HTTP front: an OpenAI-compatible FastAPI app over an ``InstancePool``.

* ``POST /v1/completions``, ``/v1/chat/completions``: prefill on a prefill instance, then
  the decode on a decode instance (``proxy``); the decode's answer goes to the client
  unchanged (a stream event by event). An instance's own error (a 4xx for a bad field, ...)
  is the client's answer unchanged; the prefill's comes back without a decode.
* ``GET /v1/models``: a decode instance's answer.
* ``GET /health``: 200 when at least one instance of each role answers its own
  ``/health`` now (every instance is asked), else 503 naming the roles with none; the body
  lists every instance and its state.

Errors of the router itself are OpenAI's body ``{"error": {message, type, param, code}}``:
a body that is not a JSON object is a 400; no instance of a role reachable is a 503 whose
message names the role and each instance with why it is down; an instance that fails
after it got the request is a 502 naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from http import HTTPStatus
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

import kvloom
from kvloom.entrypoints.openai.error_handlers import install_error_handlers, request_id_of
from kvloom.entrypoints.openai.errors import APIError, parse_json_body
from kvloom.entrypoints.openai.limits import run_blocking
from kvloom.entrypoints.openai.request_guard import RequestGuard
from kvloom.entrypoints.openai.routers.shared import (
    CLIENT_CLOSED_REQUEST,
    ClosingStreamingResponse,
    run_until_disconnected,
)
from kvloom.entrypoints.router.instances import InstancePool
from kvloom.entrypoints.router.proxy import (
    decode_request,
    forwarded_headers,
    prefill,
    read_all,
    relay_stream,
    returned_headers,
    send,
)

logger = logging.getLogger(__name__)

#: The largest request body the router takes by default (the instances apply their own limit).
DEFAULT_MAX_BODY_BYTES = 64 * 2**20
#: Paths whose requests are split into a prefill and a decode.
DISAGGREGATED_PATHS = ("/v1/completions", "/v1/chat/completions")


def build_app(pool: InstancePool, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The router's app over ``pool`` (whose instances the caller checks: ``wait_until_up``)."""
    app = FastAPI(title="kvloom router", version=kvloom.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.pool = pool
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes)
    install_error_handlers(app)
    for path in DISAGGREGATED_PATHS:
        app.add_api_route(path, _disaggregated_endpoint(path), methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    return app


def _pool(request: Request) -> InstancePool:
    return request.app.state.pool


async def _read_object(request: Request) -> dict[str, Any]:
    body = await request.body()
    data = await run_blocking(len(body), parse_json_body, body)
    if not isinstance(data, dict):
        raise APIError(f"Request body must be a JSON object (got {type(data).__name__})", code="invalid_json")
    return data


def _disaggregated_endpoint(path: str) -> Any:
    async def endpoint(raw: Request) -> Response:
        body = await _read_object(raw)
        response = await run_until_disconnected(
            raw, disaggregate(_pool(raw), path, body, forwarded_headers(raw.headers, request_id_of(raw)))
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST) if response is None else response

    endpoint.__name__ = "disaggregated_" + path.strip("/").replace("/", "_")
    return endpoint


async def disaggregate(pool: InstancePool, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
    """``body`` prefilled on a prefill instance, then decoded on a decode instance: the
    decode's response (streamed when it streams), or the prefill's when it is an error."""
    prefilled, content, reply = await prefill(pool, path, body, headers)
    if reply is None:
        return Response(content, status_code=prefilled.status_code, headers=returned_headers(prefilled))
    instance, response = await send(pool, "decode", "POST", path, headers, decode_request(body, reply))
    if response.status_code == HTTPStatus.OK and response.headers.get("content-type", "").startswith(
        "text/event-stream"
    ):
        return ClosingStreamingResponse(relay_stream(instance, response), headers=returned_headers(response))
    content = await read_all(instance, response)
    return Response(content, status_code=response.status_code, headers=returned_headers(response))


async def models(raw: Request) -> Response:
    headers = forwarded_headers(raw.headers, request_id_of(raw))
    instance, response = await send(_pool(raw), "decode", "GET", "/v1/models", headers)
    content = await read_all(instance, response)
    return Response(content, status_code=response.status_code, headers=returned_headers(response))


async def health(raw: Request) -> Response:
    pool = _pool(raw)
    await pool.check_all()
    body: dict[str, Any] = {role: [{"url": i.url, "up": i.up, **({"reason": i.reason} if not i.up else {})}
                                   for i in group.instances] for role, group in pool.groups.items()}  # fmt: skip
    if pool.healthy():
        return JSONResponse(body)
    down = [role for role, group in pool.groups.items() if not any(i.up for i in group.instances)]
    error = APIError("; ".join(pool.unavailable_message(role) for role in down), status=HTTPStatus.SERVICE_UNAVAILABLE,
                     code=int(HTTPStatus.SERVICE_UNAVAILABLE), type="service_unavailable_error")  # fmt: skip
    return JSONResponse({**error.body(), **body}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)


def instance_client() -> httpx.AsyncClient:
    """The client the router reaches its instances with: connections kept open, no read
    timeout (a long generation streams for minutes), a short connect timeout (an instance
    that does not answer is down)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))  # fmt: skip


async def serve_router(prefill_urls: list[str], decode_urls: list[str], host: str = "0.0.0.0", port: int = 8000,
                       startup_timeout: float = 60.0, health_interval: float = 10.0,
                       max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, uvicorn_log_level: str = "info",
                       access_log: bool = True) -> int:  # fmt: skip
    """Check the instances (up to ``startup_timeout`` seconds), then route on ``host:port``
    until SIGINT/SIGTERM, checking the instances that are down every ``health_interval``
    seconds. Returns the exit status."""
    async with instance_client() as client:
        pool = InstancePool(prefill_urls, decode_urls, client)
        await pool.wait_until_up(startup_timeout)
        rechecks = asyncio.create_task(pool.recheck_down_forever(health_interval))
        try:
            config = uvicorn.Config(build_app(pool, max_body_bytes), host=host, port=port,
                                    log_level=uvicorn_log_level, access_log=access_log)  # fmt: skip
            logger.info("kvloom %s router on http://%s:%d: prefill %s; decode %s", kvloom.__version__, host, port,
                        ", ".join(i.url for i in pool.groups["prefill"].instances),
                        ", ".join(i.url for i in pool.groups["decode"].instances))  # fmt: skip
            await uvicorn.Server(config).serve()
        finally:
            rechecks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rechecks
    return 0
