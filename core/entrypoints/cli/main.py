"""The ``kvloom`` command. Each subcommand module has ``register(subparsers)``, which adds
its parser and sets ``func`` (called with the parsed namespace, returns the exit code)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kvloom


def build_parser() -> argparse.ArgumentParser:
    from kvloom.entrypoints.cli import bench_serve, serve

    parser = argparse.ArgumentParser(prog="kvloom", description="kvloom: LLM inference and serving.")
    parser.add_argument("--version", action="version", version=f"kvloom {kvloom.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.register(commands)
    bench = commands.add_parser("bench", help="Benchmarks.", description="Benchmarks.")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    bench_serve.register(benchmarks)
    return parser


def configure_logging() -> None:
    level = os.environ.get("KVLOOM_LOGGING_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s [%(name)s] %(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
