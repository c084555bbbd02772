"""The ``NAME+option+option`` run specs of the benchmarks (``TRITON_ATTN+async+tp2``,
``graphs+async+nocompile``): one parser, so every benchmark reads ``+tpN`` the same way."""

from __future__ import annotations

import re
from collections.abc import Iterable


def parse_run_spec(spec: str, allowed: Iterable[str]) -> tuple[str, set[str], int]:
    """``spec``'s name, its options (each one of ``allowed``) and the tensor-parallel size
    its ``+tpN`` option asks for (1 without one); anything else is a ``ValueError``
    naming the allowed options."""
    name, *options = spec.split("+")
    allowed = list(allowed)
    tp = [o for o in options if re.fullmatch(r"tp[1-9][0-9]*", o)]
    if set(options) - set(allowed) - set(tp) or len(tp) > 1:
        raise ValueError(f"unknown run option in {spec!r} (allowed: {', '.join('+' + a for a in allowed)}, one +tpN)")
    return name, set(options) - set(tp), int(tp[0][2:]) if tp else 1


def torch_compile_option(spec: str, options: set[str]) -> bool | None:
    """What ``spec``'s ``+compile`` / ``+nocompile`` option asks of ``torch_compile``:
    True, False, or None (neither: the platform's default); both is a ``ValueError``."""
    if {"compile", "nocompile"} <= options:
        raise ValueError(f"{spec!r}: +compile and +nocompile contradict each other (allowed: one of them)")
    return True if "compile" in options else False if "nocompile" in options else None
