"""The thread count this platform runs with, read by the platform (is it available?) and by
its worker (``torch.set_num_threads``): a module below both, so that neither imports the other."""

from __future__ import annotations

import os

THREADS_ENV = "KVLOOM_CPU_THREADS_PLATFORM"


def configured_threads() -> int | None:
    """The thread count from ``KVLOOM_CPU_THREADS_PLATFORM``; None when unset."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive number of threads, got {value!r}")
    return int(value)
