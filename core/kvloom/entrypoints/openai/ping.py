"""GET/POST /ping: vLLM's liveness probe (SageMaker's convention), answered as /health is."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvloom.entrypoints.openai.error_handlers import error_response
from kvloom.entrypoints.openai.errors import APIError
from kvloom.entrypoints.openai.routers.shared import server_context

logger = logging.getLogger(__name__)

router = APIRouter()


async def health_response(engine: Any) -> Response:
    """200 while the engine core is alive, else 503 with the reason."""
    try:
        await engine.check_health()
    except Exception as exc:
        logger.error("Health check failed: %s", exc)
        return error_response(APIError(f"Engine is not healthy: {exc}", status=HTTPStatus.SERVICE_UNAVAILABLE))
    return Response(status_code=HTTPStatus.OK)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    return await health_response(server_context(request.app).engine)
