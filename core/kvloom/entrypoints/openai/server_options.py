"""How the HTTP server presents itself (``kvloom serve``'s flags of vLLM's ``FrontendArgs``,
hence the class name): the assistant role name, request logging, CORS, TLS, the root
path, the docs pages, tool calling. Not the engine's ``engine/frontend.py``, the request
half of ``LLMEngine``/``AsyncLLM``.

``FrontendOptions`` travels from the CLI to every API server process (it is plain data);
``build_app`` applies the app-side options (``install_cors``, docs), ``uvicorn_kwargs``
the server-side ones (TLS, root path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendOptions:
    response_role: str = "assistant"
    """The role of the reply in chat completions (``--response-role``)."""
    enable_log_requests: bool = False
    """Log every request's id, prompt size and sampling parameters (``--enable-log-requests``)."""
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    cors: bool = False
    """Answer CORS preflights and add CORS headers (any ``--allowed-*``/``--allow-credentials``
    flag turns it on; vLLM always installs the middleware, with the same defaults)."""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    root_path: str | None = None
    """The path prefix a proxy serves the app under (``--root-path``, ASGI's root_path)."""
    disable_fastapi_docs: bool = False
    enable_auto_tool_choice: bool = False
    """Tool choice "auto": the model may call tools (``--enable-auto-tool-choice``)."""
    tool_call_parser: str | None = None
    """The tool-call parser's name (``--tool-call-parser``)."""

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile: give both (TLS needs the key and its certificate)")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag}: {path} is not a file")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser NAME (hermes, llama3_json or a "
                             "plugin's)")  # fmt: skip
        if self.tool_call_parser is not None:
            from kvloom.tool_parsers.registry import get_tool_parser_cls

            get_tool_parser_cls(self.tool_call_parser)  # a ValueError naming the parsers there are
        if not self.response_role or len(self.response_role) > 64:
            raise ValueError(f"--response-role: {self.response_role!r} must be 1..64 characters")
        if self.root_path is not None and self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path: {self.root_path!r} must start with '/'")

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``uvicorn.Config`` these options set."""
        kwargs: dict[str, Any] = {}
        if self.ssl_keyfile is not None:
            kwargs.update(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile)
        if self.root_path:
            kwargs["root_path"] = self.root_path
        return kwargs

    def install_cors(self, app: Any) -> None:
        if not self.cors:
            return
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)  # fmt: skip
        logger.info("CORS: origins %s, methods %s, headers %s, credentials %s", list(self.allowed_origins),
                    list(self.allowed_methods), list(self.allowed_headers), self.allow_credentials)  # fmt: skip
