"""How an error becomes an HTTP response: OpenAI's body ``{"error": {message, type, param,
code}}`` (``errors.APIError``), or Anthropic's on its API (``/v1/messages``), never FastAPI's
own shapes.

``install_error_handlers(app)`` turns an ``APIError`` into its response, FastAPI's
validation errors and Starlette's HTTP errors (404, 405) into OpenAI's 400 / status, and
anything else into a 500 that says "internal error" with the request id (the details go
to the log). ``RequestGuard`` gives every request that id and answers an error no handler
took the same way.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvloom.entrypoints.anthropic.protocol import ANTHROPIC_PATH
from kvloom.entrypoints.anthropic.protocol import error_body as anthropic_error_body
from kvloom.entrypoints.openai.errors import APIError, from_validation_errors, internal_error

logger = logging.getLogger(__name__)

#: Where ``RequestGuard`` keeps the request's id in the ASGI scope.
REQUEST_ID_SCOPE_KEY = "kvloom.request_id"


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """``error`` in OpenAI's body, or in Anthropic's on Anthropic's API (``path``)."""
    headers = {"WWW-Authenticate": "Bearer"} if error.status == HTTPStatus.UNAUTHORIZED else None
    body = anthropic_error_body(error.status, error.message) if path.startswith(ANTHROPIC_PATH) else error.body()
    return JSONResponse(body, status_code=error.status, headers=headers)


def request_id_of(request: Request) -> str:
    """The id ``RequestGuard`` gave the request (also its ``X-Request-Id`` response header)."""
    return request.scope.get(REQUEST_ID_SCOPE_KEY) or "unknown"


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(from_validation_errors(exc.errors()), request.url.path)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(str(exc.detail), status=exc.status_code), request.url.path)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    request_id = request_id_of(request)
    logger.error("Unhandled error serving %s %s (request id %s)", request.method, request.url.path, request_id,
                 exc_info=exc)  # fmt: skip
    return error_response(internal_error(request_id), request.url.path)
