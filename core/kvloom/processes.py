"""Helpers for the processes kvloom spawns (engine cores, tensor-parallel workers):
starting one without re-running the caller's ``__main__``, and describing how one ended."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def main_module_not_reimported() -> Iterator[None]:
    """Start the spawned process without re-running the caller's ``__main__`` in it:
    a script that makes an ``LLM`` at top level, without an ``if __name__ ==
    "__main__"`` guard, would otherwise start another engine from the engine core."""
    main = sys.modules.get("__main__")
    saved = {name: main.__dict__[name] for name in ("__spec__", "__file__") if main and name in main.__dict__}
    try:
        if main is not None:
            main.__dict__["__spec__"] = None
            main.__dict__.pop("__file__", None)
        yield
    finally:
        if main is not None:
            for name in ("__spec__", "__file__"):
                main.__dict__.pop(name, None)
            main.__dict__.update(saved)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is gone"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"
