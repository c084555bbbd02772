"""GET /v1/models: the served model and its LoRA adapters."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from kvloom.entrypoints.openai.routers.shared import require_api_key, server_context

router = APIRouter(dependencies=[Depends(require_api_key)])


def attach_router(app: FastAPI) -> None:
    app.include_router(router)


@router.get("/v1/models")
async def list_models(raw: Request) -> JSONResponse:
    return JSONResponse(server_context(raw.app).models.model_list().model_dump(mode="json"))
