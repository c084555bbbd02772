"""The API server's event loop: uvloop where it is installed (a dependency on Linux, as vLLM's
server runs on it), else asyncio's own.

Why: every streamed token is a few callbacks of the server's loop (the engine's output
socket, the request's stream, the HTTP write), and at one H200's 15k tokens a second the
loop's own cost decides whether the front end keeps up with the engine (one token per
event) or falls behind and merges tokens into fewer events (issue 35:
``docs/benchmarks/frontend_stream_cpu.md``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["run"]


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a uvloop loop when uvloop imports."""
    try:
        import uvloop
    except ImportError:
        logger.debug("uvloop is not installed: the server runs on asyncio's event loop")
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
