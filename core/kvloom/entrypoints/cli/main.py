"""The ``kvloom`` command.

Each subcommand lives in its own module that provides
``register_subparser(subparsers) -> None``: it adds its parser to ``subparsers`` and sets
``func`` (called with the parsed arguments; returns the exit status). Add a subcommand by
appending its module to ``SUBCOMMAND_MODULES``. Subcommand modules must keep their
top-level imports light so that ``kvloom --help`` stays fast: import the engine inside
``func``.

Environment: ``KVLOOM_LOGGING_LEVEL`` (default INFO; logs go to stderr, so ``--json``
output on stdout stays clean). A usage error (a bad or refused flag) prints one line
(``kvloom serve: error: ...``) and where the usage is, and exits 2; any other error prints
one line (``kvloom: error: ...``) and exits 1; with ``--debug`` (after any subcommand) or at DEBUG it also prints its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
import typing
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
    "kvloom.entrypoints.cli.router",
    "kvloom.entrypoints.cli.bench",
    "kvloom.entrypoints.cli.backends",
]

logger = logging.getLogger("kvloom.cli")


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage error is one line naming the problem, then where the usage is: argparse's
    default first prints the whole usage, which for ``kvloom serve`` (every engine and vLLM
    flag) is a hundred lines that bury the reason. Subcommand parsers are of this class too
    (``add_subparsers`` makes its parsers of the parent's class)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for usage.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="kvloom",
        description="kvloom: an LLM inference and serving engine built as a core plus plugins.",
    )
    parser.add_argument("--version", action="version", version=f"kvloom {kvloom.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register_subparser(subparsers)
    _add_debug_flag(parser)
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


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug`` on ``parser`` and every subcommand's parser (it may follow any of them)."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="On an error, print its Python traceback.")  # fmt: skip
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
                _add_debug_flag(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvloom`` console script; returns the exit status."""
    _setup_logging()
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False) or logger.isEnabledFor(logging.DEBUG)

    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("kvloom: interrupted", file=sys.stderr)
        return 130
    except (PluginError, ValueError, FileNotFoundError) as exc:
        # Plugin problems and bad input: the message says what to do (plugin errors
        # carry the plugin's own traceback); our stack adds nothing, except when debugging.
        if debug:
            traceback.print_exc()
        print(f"kvloom: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        # Anything else is unexpected: one line saying what, and how to see where.
        if debug:
            traceback.print_exc()
            print(f"kvloom: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        else:
            print(f"kvloom: error: {type(exc).__name__}: {exc} (run with --debug or KVLOOM_LOGGING_LEVEL=DEBUG "
                  "for the traceback)", file=sys.stderr)  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(main())
