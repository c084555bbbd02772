"""The ``kvloom`` command.

Each subcommand lives in its own module that provides
``register_subparser(subparsers) -> None``: it adds its parser to ``subparsers`` and sets
``func`` (called with the parsed arguments; returns the exit status). Add a subcommand by
appending its module to ``SUBCOMMAND_MODULES``. Subcommand modules must keep their
top-level imports light so that ``kvloom --help`` stays fast: import the engine inside
``func``.

Environment: ``KVLOOM_LOGGING_LEVEL`` (default INFO; logs go to stderr, so ``--json``
output on stdout stays clean). At DEBUG, errors also print their Python traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from kvloom_registry import PluginError

import kvloom
from kvloom.logger import DATE_FORMAT as LOG_DATE_FORMAT
from kvloom.logger import FORMAT as LOG_FORMAT
from kvloom.logger import configure_logging, logging_level

#: Modules providing ``register_subparser(subparsers)``, in the order ``--help`` lists them.
SUBCOMMAND_MODULES: list[str] = [
    "kvloom.entrypoints.cli.generate",
    "kvloom.entrypoints.cli.chat",
    "kvloom.entrypoints.cli.serve",
    "kvloom.entrypoints.cli.bench",
    "kvloom.entrypoints.cli.backends",
]

logger = logging.getLogger("kvloom.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvloom",
        description="kvloom: an LLM inference and serving engine built as a core plus plugins.",
    )
    parser.add_argument("--version", action="version", version=f"kvloom {kvloom.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register_subparser(subparsers)
    return parser


def _setup_logging() -> None:
    # The command always logs (KVLOOM_CONFIGURE_LOGGING governs the library's import only);
    # other libraries' loggers go through the root logger, in the same format.
    try:
        level = logging_level()
    except ValueError as exc:
        raise SystemExit(f"kvloom: error: {exc}") from None
    configure_logging(level)
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT, stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvloom`` console script; returns the exit status."""
    _setup_logging()
    args = build_parser().parse_args(argv)

    try:
        return int(args.func(args) or 0)
    except (PluginError, ValueError, FileNotFoundError) as exc:
        # Plugin problems and bad input: the message says what to do (plugin errors
        # carry the plugin's own traceback); our stack adds nothing, except when debugging.
        if logger.isEnabledFor(logging.DEBUG):
            logger.exception("kvloom %s failed", args.command)
        print(f"kvloom: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
