"""Small helpers with no better home."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` items."""
    return -(-a // b)
