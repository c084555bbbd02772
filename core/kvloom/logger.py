"""kvloom's log output, configured on ``import kvloom`` as vLLM does.

The ``kvloom`` logger gets one stderr handler printing ``INFO 11-25 17:40:01 [llm.py:123]
message`` at ``KVLOOM_LOGGING_LEVEL`` (default INFO) and stops propagating to the root
logger (so an application's own root handler does not print each line twice).
``KVLOOM_CONFIGURE_LOGGING=0`` leaves the ``kvloom`` logger alone: its records then
propagate to whatever the application configured. The ``kvloom`` command configures it
regardless (a command line tool always reports its progress).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys

CONFIGURE_ENV = "KVLOOM_CONFIGURE_LOGGING"
LEVEL_ENV = "KVLOOM_LOGGING_LEVEL"
LOGGER_NAME = "kvloom"
FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _KvloomHandler(logging.StreamHandler):
    """Marks the handler kvloom installed, so configuring again replaces it."""


def logging_level() -> int:
    """``KVLOOM_LOGGING_LEVEL`` as a ``logging`` level; a ``ValueError`` names the
    variable and the allowed values."""
    name = os.environ.get(LEVEL_ENV, "INFO").strip().upper() or "INFO"
    if name not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={name!r} (allowed: {', '.join(LEVELS)})")
    return logging.getLevelName(name)


def configuration_enabled() -> bool:
    value = os.environ.get(CONFIGURE_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true"):
        raise ValueError(f"{CONFIGURE_ENV}={value!r} (allowed: 1 or 0)")
    return value in ("1", "true")


def configure_logging(level: int | None = None, prefix: str = "") -> logging.Logger:
    """Give the ``kvloom`` logger its stderr handler (replacing one installed before)
    at ``level`` (default: ``KVLOOM_LOGGING_LEVEL``); ``prefix`` starts every line (the
    engine core and API server processes name themselves with it)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if isinstance(h, _KvloomHandler)]:
        logger.removeHandler(handler)
    handler = _KvloomHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(prefix + FORMAT, datefmt=DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(logging_level() if level is None else level)
    logger.propagate = False
    return logger


def is_configured() -> bool:
    """Whether kvloom's handler is installed on the ``kvloom`` logger."""
    return any(isinstance(h, _KvloomHandler) for h in logging.getLogger(LOGGER_NAME).handlers)


def configure_logging_on_import() -> None:
    """What ``import kvloom`` does: ``configure_logging()`` unless
    ``KVLOOM_CONFIGURE_LOGGING=0``. A bad ``KVLOOM_LOGGING_LEVEL`` is reported on stderr
    (an import must not fail over a log level) and INFO is used."""
    try:
        if not configuration_enabled():
            return
        level = logging_level()
    except ValueError as exc:
        print(f"kvloom: {exc}; logging at INFO", file=sys.stderr)
        level = logging.INFO
    configure_logging(level)


def parent_logging() -> tuple[int | None, str | None]:
    """How a child process (engine core, API server) should log, as this process does:
    (level, None) when kvloom's handler is installed here; (level, root format) when
    only the application's root logger is configured; (None, None) when nothing is
    (Python's warnings-only default)."""
    kvloom_logger = logging.getLogger(LOGGER_NAME)
    if is_configured():
        return kvloom_logger.getEffectiveLevel(), None
    root = logging.getLogger()
    if not root.handlers:
        return None, None
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None and h.formatter._fmt), None)
    return kvloom_logger.getEffectiveLevel(), fmt or "%(levelname)s %(name)s: %(message)s"


def setup_child_logging(level: int | None, fmt: str | None, prefix: str) -> None:
    """Log in a child process as ``parent_logging()`` said, every line starting with
    ``prefix`` (e.g. ``(EngineCore_0 pid=123) ``)."""
    if level is None:
        return
    if fmt is None:
        configure_logging(level, prefix)
        fmt = FORMAT
    logging.basicConfig(level=level, format=prefix + fmt, datefmt=DATE_FORMAT, stream=sys.stderr)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` makes this process print every thread's Python stack to
    stderr (``faulthandler``) and go on: how to see where a hung engine core or worker
    waits, e.g. on a collective. The engine core and the distributed workers call this at
    start-up; no-op where the signal does not exist (Windows)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
