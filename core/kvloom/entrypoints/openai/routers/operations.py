"""The open operational endpoints: GET /health, /version and /metrics (no API key, as in
vLLM: supervisors and scrapers call them)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import prometheus_client
import prometheus_client.multiprocess
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

import kvloom
from kvloom.entrypoints.openai.ping import health_response
from kvloom.entrypoints.openai.routers.shared import server_context
from kvloom.metrics.loggers import PrometheusStatLogger, multiprocess_metrics_dir

if TYPE_CHECKING:
    from kvloom.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

router = APIRouter()


def attach_router(app: FastAPI) -> None:
    app.include_router(router)


@router.get("/health")
async def health(raw: Request) -> Response:
    return await health_response(server_context(raw.app).engine)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": kvloom.__version__})


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(metrics_text(server_context(raw.app).engine), media_type=prometheus_client.CONTENT_TYPE_LATEST)


def metrics_text(engine: AsyncLLM) -> bytes:
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
