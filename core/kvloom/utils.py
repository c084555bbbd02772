"""Small helpers with no better home."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` items."""
    return -(-a // b)


def kvloom_cache_dir() -> "Path":
    """kvloom's on-disk cache root: ``$KVLOOM_CACHE_DIR``, default ``~/.cache/kvloom``."""
    import os
    from pathlib import Path

    return Path(os.environ.get("KVLOOM_CACHE_DIR", Path.home() / ".cache" / "kvloom"))
