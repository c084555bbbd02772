"""``kvloom router --prefill URL --decode URL``: the proxy of disaggregated prefill/decode
(``kvloom.entrypoints.router``)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

DESCRIPTION = """\
An OpenAI-compatible proxy in front of prefill and decode instances (kvloom serve with a
KV connector, e.g. --kv-transfer-config with kv_role kv_producer for prefill and
kv_consumer for decode). POST /v1/completions and /v1/chat/completions are prefilled on a
prefill instance (max_tokens 1), then decoded on a decode instance with the prefill's
kv_transfer_params; the decode's answer (streamed or whole) goes back unchanged. Several
instances of a role are taken in turn; one that cannot be reached is skipped (the request
goes to the next) and checked again later. GET /health is 200 when at least one instance
of each role is healthy; GET /v1/models comes from a decode instance. With no instance of
a role reachable, requests get a 503 naming the role and the instances."""


def register_subparser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "router",
        help="Route each request's prefill and decode to separate instances (disaggregated serving).",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="A prefill instance (http://HOST:PORT); repeat for several.")  # fmt: skip
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="A decode instance (http://HOST:PORT); repeat for several.")  # fmt: skip
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on (default: 0.0.0.0, all interfaces).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    parser.add_argument("--startup-timeout", type=_non_negative, default=60.0, metavar="SECONDS",
                        help="How long to wait at start for the instances' /health (default: 60); the router "
                             "starts once every instance answers, or at the timeout with at least one of each "
                             "role (else it exits with an error).")  # fmt: skip
    parser.add_argument("--health-check-interval", type=_positive, default=10.0, metavar="SECONDS",
                        help="How often instances that are down are checked again (default: 10).")  # fmt: skip
    parser.add_argument("--max-request-body-bytes", type=int, default=None, metavar="BYTES",
                        help="The largest request body the router takes (default: 64 MiB).")  # fmt: skip
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default: info).")  # fmt: skip
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every HTTP request.")
    parser.set_defaults(func=run_router)


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (got {text})")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (got {text})")
    return value


def run_router(args: argparse.Namespace) -> int:
    from kvloom.entrypoints.router.app import DEFAULT_MAX_BODY_BYTES, serve_router

    max_body = args.max_request_body_bytes if args.max_request_body_bytes is not None else DEFAULT_MAX_BODY_BYTES
    if max_body < 1024:
        raise ValueError(f"--max-request-body-bytes: must be at least 1024 (got {max_body})")
    return asyncio.run(serve_router(args.prefill, args.decode, host=args.host, port=args.port,
                                    startup_timeout=args.startup_timeout, health_interval=args.health_check_interval,
                                    max_body_bytes=max_body, uvicorn_log_level=args.uvicorn_log_level,
                                    access_log=not args.disable_uvicorn_access_log))  # fmt: skip
