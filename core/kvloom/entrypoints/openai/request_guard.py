"""``RequestGuard``: the ASGI middleware in front of every route, so that no request can
hurt the others before a route runs (with ``limits.ServerLimits``).

It gives each request its id, refuses a body that is not JSON (415) or too large (413)
before or while it is read, and answers "internal error" with the id for an error no
exception handler took (``error_handlers.py``).
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus
from typing import Any

from kvloom.entrypoints.openai.error_handlers import REQUEST_ID_SCOPE_KEY, error_response
from kvloom.entrypoints.openai.errors import APIError, internal_error

logger = logging.getLogger(__name__)

#: Media types a request body may have: JSON, or none said.
_JSON_MEDIA_TYPES = ("application/json",)
_REQUEST_ID_HEADER = b"x-request-id"


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
        scope[REQUEST_ID_SCOPE_KEY] = request_id

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
