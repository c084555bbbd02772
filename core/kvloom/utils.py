"""Small helpers with no better home."""

from __future__ import annotations

import gc


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` items."""
    return -(-a // b)


def kvloom_cache_dir() -> "Path":
    """kvloom's on-disk cache root: ``$KVLOOM_CACHE_DIR``, default ``~/.cache/kvloom``."""
    import os
    from pathlib import Path

    return Path(os.environ.get("KVLOOM_CACHE_DIR", Path.home() / ".cache" / "kvloom"))


def freeze_gc_heap() -> None:
    """Collect the garbage, then move every object this process holds into the cyclic
    garbage collector's permanent generation (``gc.freeze``).

    For a process that built its long-lived state (an engine core: the model, torch's and
    the libraries' objects, some 250,000 of them) and now allocates per step: a full
    collection, which a step loop at batch 256 triggers about every 100 steps, would walk
    all of them each time (~170 ms on the CPU benchmark, ~1.7 ms per step on average,
    ``docs/benchmarks/host_step_cpu.md``). Reference counting still frees frozen objects;
    only reference cycles among them are never collected, so call it once, after start-up,
    in a process whose start-up state lives as long as it does."""
    gc.collect()
    gc.freeze()
