"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies), attached only
with ``KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1``: they let clients load adapters from the
server machine's files."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from kvloom.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from kvloom.entrypoints.openai.routers.shared import read_body, require_api_key, server_context
from kvloom.entrypoints.openai.serving_models import runtime_lora_updating_allowed

logger = logging.getLogger(__name__)

router = APIRouter(dependencies=[Depends(require_api_key)])


def attach_router(app: FastAPI) -> None:
    if not runtime_lora_updating_allowed():
        return
    logger.warning("Runtime LoRA updating is on (KVLOOM_ALLOW_RUNTIME_LORA_UPDATING): clients may load "
                   "adapters from this machine's files")  # fmt: skip
    app.include_router(router)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(raw: Request) -> Response:
    request = await read_body(raw, LoadLoRAAdapterRequest)
    await server_context(raw.app).models.load_lora_adapter(request.lora_name, request.lora_path)
    return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(raw: Request) -> Response:
    request = await read_body(raw, UnloadLoRAAdapterRequest)
    await server_context(raw.app).models.unload_lora_adapter(request.lora_name)
    return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.", media_type="text/plain")
