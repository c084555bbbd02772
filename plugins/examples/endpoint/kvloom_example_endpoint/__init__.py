"""An endpoint plugin: ``POST /v1/example/token_count`` with ``{"text": "..."}`` answers how
many tokens the served model's tokenizer makes of the text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvloom.interfaces import APIError, EndpointPlugin

KVLOOM_PLUGIN_API = "1.1"


class TokenCount(EndpointPlugin):
    name = "example_token_count"

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.post("/v1/example/token_count")
        async def token_count(request: Request) -> dict[str, Any]:
            server = request.app.state.kvloom  # the engine, read_json (with the server's limits), ...
            body = await server.read_json(request)
            text = body.get("text") if isinstance(body, dict) else None
            if not isinstance(text, str):
                raise APIError("text: must be a string", param="text")  # a 400 in OpenAI's shape
            tokenizer = server.engine.tokenizer
            return {"model": server.engine.config.model.served_model_name,
                    "tokens": len(tokenizer.encode(text, add_special_tokens=False))}

        return router
