"""The contract of an endpoint plugin (the ``kvloom.endpoint_plugins`` entry-point group):
extra HTTP routes for ``kvloom serve``.

An endpoint plugin widens what a server exposes, so it loads only when ``KVLOOM_PLUGINS``
names it (unlike the other kinds, which load when installed unless the variable leaves
them out). Its routes sit behind ``--api-key`` like the model endpoints, under the server's
request limits (body size, Content-Type), and a route that clashes with one of the
server's is refused when the server starts.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from fastapi import APIRouter


class EndpointPlugin(abc.ABC):
    """Extra routes for the server. ``name`` is the entry-point name (what
    ``KVLOOM_PLUGINS`` must list). kvloom makes one instance per API server process and
    includes ``router()``'s routes in its app.

    Handlers reach the server through ``request.app.state.kvloom`` (the engine, the
    served models, ``read_body``/``read_json`` with the request limits applied, ``respond``
    for a JSON or server-sent-event answer that aborts its engine requests when the client
    goes away). An ``APIError`` raised in a handler is answered with OpenAI's error body and
    its status; anything else is a 500 that says only "internal error" and the request id."""

    name: ClassVar[str]
    """The entry-point name."""

    @abc.abstractmethod
    def router(self) -> "APIRouter":
        """A FastAPI ``APIRouter`` with the plugin's routes (their paths as served)."""
