"""``kvloom serve [MODEL]``: the OpenAI-compatible server, with every engine flag."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
from typing import TYPE_CHECKING

from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from kvloom.entrypoints.cli.vllm_flags import add_vllm_flags
from kvloom.entrypoints.openai.errors import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_JSON_NUMBER_LENGTH
from kvloom.entrypoints.openai.limits import (
    BODY_BYTES_PER_TOKEN,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    MIN_DEFAULT_BODY_BYTES,
    ServerLimits,
)
from kvloom.entrypoints.openai.server_options import FrontendOptions
from kvloom.profiling import cprofile_if_asked

if TYPE_CHECKING:
    from kvloom.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

#: The most API server processes ``--api-server-count`` may ask for (each loads a tokenizer
#: and runs an event loop: beyond the CPU count they only compete).
MAX_API_SERVER_COUNT = 64

DESCRIPTION = """\
Start the OpenAI-compatible API server (POST /v1/completions, /v1/chat/completions,
/v1/responses, /v1/messages (Anthropic's API), /v1/embeddings, /v1/score, /v1/rerank,
GET /v1/models, /health, /ping, /version, /metrics, POST /tokenize, /detokenize).
MODEL is an HF model directory or a .gguf file; without one, the built-in
SmolLM2-135M-Instruct is served."""


def register_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    server = parser.add_argument_group("server arguments")
    server.add_argument("--host", default="0.0.0.0", help="Address to listen on (default: 0.0.0.0, all interfaces).")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    server.add_argument(
        "--api-key",
        default=os.environ.get("KVLOOM_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1/* (default: $KVLOOM_API_KEY, else no key).",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: info).",
    )
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every HTTP request.")
    server.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes sharing the port, each with its own HTTP, tokenization and detokenization, "
        f"all over the same engine core(s) (default: %(default)s; allowed: 1..{MAX_API_SERVER_COUNT}).",
    )
    server.add_argument("--response-role", default="assistant",
                        help="The role of the reply in chat completions (default: %(default)s).")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='Let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser.')
    server.add_argument("--tool-call-parser", default=None,
                        help="How tool calls are found in the model's output: hermes, llama3_json or a plugin's "
                             "name (the kvloom.tool_parsers entry-point group).")
    server.add_argument("--root-path", default=None,
                        help="The path prefix a reverse proxy serves the API under (ASGI root_path).")
    server.add_argument("--ssl-keyfile", default=None, help="TLS private key file (with --ssl-certfile: HTTPS).")
    server.add_argument("--ssl-certfile", default=None, help="TLS certificate file (with --ssl-keyfile: HTTPS).")
    server.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=None,
                        help='CORS allowed origins, a JSON list (default: ["*"] once a CORS flag is given).')
    server.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=None,
                        help='CORS allowed methods, a JSON list (default: ["*"]).')
    server.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=None,
                        help='CORS allowed headers, a JSON list (default: ["*"]).')
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    server.add_argument("--disable-fastapi-docs", action="store_true", help="No /docs, /redoc and /openapi.json.")
    logging_group = server.add_mutually_exclusive_group()
    logging_group.add_argument("--enable-log-requests", action="store_true",
                               help="Log each request's id, prompt size and sampling parameters.")
    logging_group.add_argument("--disable-log-requests", action="store_true",
                               help="Do not log requests (the default; vLLM's older spelling).")
    limits = parser.add_argument_group("request limits (what one request may ask of the server)")
    limits.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="Refuse larger request bodies with 413 (default: enough for a prompt of max-model-len tokens, "
        f"{BODY_BYTES_PER_TOKEN} bytes a token, and at least {MIN_DEFAULT_BODY_BYTES // 2**20} MiB).",
    )
    limits.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="Most sequences one request may start, prompts x n (default: %(default)s); more is a 400.",
    )
    limits.add_argument(
        "--max-json-depth",
        type=int,
        default=DEFAULT_MAX_JSON_DEPTH,
        help="How deeply a JSON body's arrays and objects may nest (default: %(default)s); deeper is a 400.",
    )
    limits.add_argument(
        "--max-json-number-length",
        type=int,
        default=DEFAULT_MAX_JSON_NUMBER_LENGTH,
        help="The longest number literal in a JSON body, in characters (default: %(default)s); longer is a 400.",
    )
    add_engine_args(parser)
    add_vllm_flags(parser)
    parser.set_defaults(func=run, parser=parser)
    return parser


def _json_list(flag: str) -> "type":
    """vLLM's form of the CORS flags: a JSON list of strings (``'["https://a.example"]'``)."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON list of strings such as '[\"*\"]', got {text!r}")
        return value

    return parse  # type: ignore[return-value]


def frontend_options(args: argparse.Namespace) -> FrontendOptions:
    """The ``FrontendOptions`` of the server flags (a ``ValueError`` naming a bad one)."""
    cors_flags = (args.allowed_origins, args.allowed_methods, args.allowed_headers)
    return FrontendOptions(
        response_role=args.response_role,
        enable_log_requests=args.enable_log_requests,
        allowed_origins=tuple(args.allowed_origins or ["*"]),
        allowed_methods=tuple(args.allowed_methods or ["*"]),
        allowed_headers=tuple(args.allowed_headers or ["*"]),
        allow_credentials=args.allow_credentials,
        cors=args.allow_credentials or any(value is not None for value in cors_flags),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
        disable_fastapi_docs=args.disable_fastapi_docs,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )


def run(args: argparse.Namespace) -> int:
    from kvloom.engine.core_client import MULTIPROCESSING_ENV, multiprocessing_enabled
    from kvloom.entrypoints.openai.launcher import bind_listening_socket

    parser: argparse.ArgumentParser = args.parser
    if not 0 < args.port < 65536:
        parser.error(f"--port: {args.port} is out of range (allowed: 1..65535)")
    if not 1 <= args.api_server_count <= MAX_API_SERVER_COUNT:
        parser.error(f"--api-server-count: {args.api_server_count} is out of range (allowed: 1..{MAX_API_SERVER_COUNT})")
    if args.api_server_count > 1 and not multiprocessing_enabled():
        parser.error(f"--api-server-count {args.api_server_count}: the API servers share engine cores in processes of "
                     f"their own, and {MULTIPROCESSING_ENV}=0 asks for the engine core in this process")  # fmt: skip
    try:
        engine_args = engine_args_from_namespace(args)
        limits = ServerLimits(
            max_request_body_bytes=args.max_request_body_bytes,
            max_sequences_per_request=args.max_sequences_per_request,
            max_json_depth=args.max_json_depth,
            max_json_number_length=args.max_json_number_length,
        )
        frontend = frontend_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    # The port first (as vLLM does): one in use is an error now, not after the model loaded.
    try:
        sock = bind_listening_socket(args.host, args.port)
    except OSError as exc:
        parser.exit(1, f"{parser.prog}: error: --port: {exc} (another server is listening there; stop it or pick "
                       "another --port)\n")  # fmt: skip
    with sock:
        return _serve(args, engine_args, limits, frontend, sock)


def _serve(args: argparse.Namespace, engine_args: EngineArgs, limits: ServerLimits, frontend: FrontendOptions,
           sock: socket.socket) -> int:  # fmt: skip
    from kvloom.entrypoints.openai import event_loop
    from kvloom.entrypoints.openai.api_server import serve_http

    if args.api_server_count > 1:
        from kvloom.entrypoints.openai.launcher import ServerOptions, launch

        options = ServerOptions(host=args.host, port=args.port, api_key=args.api_key or None,
                                uvicorn_log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log, limits=limits,
                                frontend=frontend)  # fmt: skip
        status = launch(engine_args, options, args.api_server_count, sock)
        if status:
            logger.error("kvloom serve stopped because a process failed (exit status %d)", status)
        else:
            logger.info("kvloom serve stopped")
        return status
    # SIGTERM stops the server as Ctrl-C does: gracefully, exit status 0. (uvicorn shuts
    # down on either, then raises the signal again; this handler turns SIGTERM into the
    # KeyboardInterrupt below, after the engine core process has been stopped.)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        with cprofile_if_asked("api_server", 0):
            status = event_loop.run(
                serve_http(
                    engine_args,
                    host=args.host,
                    port=args.port,
                    api_key=args.api_key or None,
                    uvicorn_log_level=args.uvicorn_log_level,
                    access_log=not args.disable_uvicorn_access_log,
                    limits=limits,
                    frontend=frontend,
                    sock=sock,
                )
            )
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on Ctrl-C, then re-raises the interrupt.
        logger.info("kvloom serve stopped")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    if status:
        logger.error("kvloom serve stopped because the engine core died (exit status %d)", status)
    return status or 0


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
