"""The endpoints outside the OpenAI core set, each a router module of its own, attached to
the app by ``attach_router``: ``/ping`` (open, like ``/health``); ``/v1/score``,
``/score``, ``/v1/rerank``, ``/rerank``, ``/v2/rerank`` (``serving_score``); ``/v1/responses``
(``serving_responses``); ``/v1/messages`` and ``/v1/messages/count_tokens``
(``kvloom.entrypoints.anthropic.serving_messages``); and the routes of the endpoint plugins
``KVLOOM_PLUGINS`` names (``kvloom.entrypoint_plugin``). All but ``/ping`` need the API key."""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Match

from kvloom.entrypoints.anthropic import serving_messages
from kvloom.entrypoints.openai import ping, serving_responses, serving_score
from kvloom.entrypoints.openai.routers.shared import require_api_key, server_context

logger = logging.getLogger(__name__)


def _taken(app: FastAPI, path: str, method: str) -> bool:
    """Whether ``method path`` already reaches one of ``app``'s routes."""
    scope = {"type": "http", "path": path, "method": method, "root_path": "", "path_params": {}}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)


def attach_router(app: FastAPI) -> None:
    """Include every router above (after the chat router: two of them translate to chat)."""
    from kvloom import plugins

    context = server_context(app)
    chat = app.state.serving_chat
    auth = [Depends(require_api_key)]
    app.include_router(ping.router)
    engine, models, limits = context.engine, context.models, context.limits
    app.state.serving_score = serving_score.OpenAIServingScore(engine, models, None, limits)
    app.include_router(serving_score.router, dependencies=auth)
    app.state.serving_responses = serving_responses.OpenAIServingResponses(chat)
    app.include_router(serving_responses.router, dependencies=auth)
    app.state.serving_messages = serving_messages.AnthropicServingMessages(chat)
    app.include_router(serving_messages.router, dependencies=auth)
    for entry in plugins.endpoint_plugins():
        router = entry.target().router()
        clashes = sorted(f"{method} {route.path}" for route in router.routes if isinstance(route, APIRoute)
                         for method in route.methods if _taken(app, route.path, method))  # fmt: skip
        if clashes:
            raise ValueError(f"{entry.describe()}: its routes {', '.join(clashes)} are the server's own")
        app.include_router(router, dependencies=auth)
        logger.info("Endpoint plugin %s serves %s", entry.name,
                    ", ".join(sorted({r.path for r in router.routes if isinstance(r, APIRoute)})))  # fmt: skip
