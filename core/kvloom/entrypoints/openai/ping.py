"""GET/POST /ping: vLLM's liveness probe (SageMaker's convention), answered as /health is."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvloom.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)

router = APIRouter()


async def health_response(engine: Any) -> Response:
    """200 while the engine core is alive, else 503 with the reason."""
    try:
        await engine.check_health()
    except Exception as exc:
        logger.error("Health check failed: %s", exc)
        error = APIError(f"Engine is not healthy: {exc}", status=HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(error.body(), status_code=error.status)
    return Response(status_code=HTTPStatus.OK)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    return await health_response(request.app.state.engine)
