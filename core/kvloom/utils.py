"""Small helpers with no better home."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any


def join_prefix(prefix: str, name: str) -> str:
    """The module name ``name`` under ``prefix`` (``"model.layers.0" + "mlp"``): the dotted
    path a layer's weights and quantization rules are found by; ``name`` alone at the root."""
    return f"{prefix}.{name}" if prefix else name


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` items."""
    return -(-a // b)


def available_host_memory() -> int:
    """Bytes of memory available to new allocations (``MemAvailable`` of /proc/meminfo,
    else the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file ``path``; else a ``ValueError`` naming the file and what
    is wrong (unreadable, not JSON, or JSON but not an object)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def kvloom_cache_dir() -> Path:
    """kvloom's on-disk cache root: ``$KVLOOM_CACHE_DIR``, default ``~/.cache/kvloom``."""
    import os

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
