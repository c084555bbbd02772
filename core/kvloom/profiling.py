"""``KVLOOM_CPROFILE_DIR``: a cProfile of each kvloom process, to find where host time goes.

With the variable set to a directory, each engine core process (its busy loop: the
thread that schedules and steps), each API server process of ``kvloom serve
--api-server-count N``, and ``kvloom serve``'s own process when it serves alone run under
``cProfile`` and write ``<role>_<index>_<pid>.prof`` there when they stop (by SIGTERM too).
Read one with ``python -m pstats FILE``; ``benchmarks/bench_serving.py --profile-server``
sets the variable and prints each process's top functions. A profiler slows Python code
by about half again as much: use it to see where the time goes, not to measure.
"""

from __future__ import annotations

import contextlib
import cProfile
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)

#: The environment variable naming the directory for the profiles (unset: no profiling).
CPROFILE_DIR_ENV = "KVLOOM_CPROFILE_DIR"


@contextlib.contextmanager
def cprofile_if_asked(role: str, index: int = 0) -> Iterator[None]:
    """Profile the code in the ``with`` block (this thread only) when
    ``KVLOOM_CPROFILE_DIR`` is set, and write ``<role>_<index>_<pid>.prof`` there however
    the block ends."""
    directory = os.environ.get(CPROFILE_DIR_ENV)
    if not directory:
        yield
        return
    if not os.path.isdir(directory):
        raise ValueError(f"{CPROFILE_DIR_ENV}={directory!r} is not a directory")
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        path = os.path.join(directory, f"{role}_{index}_{os.getpid()}.prof")
        profiler.dump_stats(path)
        logger.info("cProfile of %s %d written to %s", role, index, path)
