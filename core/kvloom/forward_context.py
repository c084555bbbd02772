"""Per-step state that every attention layer reads during a forward pass.

The model runner wraps each forward in ``set_forward_context``; ``Attention`` layers read
the backend metadata from ``get_forward_context()``. Keeping it out of the model's
``forward`` signature lets every model class stay identical across backends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForwardContext:
    #: Backend metadata for this step (the profiling and warm-up runs build it too, from
    #: dummy requests).
    attn_metadata: Any
    #: Extra per-step data for layers (e.g. LoRA indices), keyed by feature name.
    extras: dict[str, Any] = field(default_factory=dict)


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: model forward must run inside set_forward_context()")
    return _current


@contextmanager
def set_forward_context(attn_metadata: Any, **extras: Any) -> Iterator[ForwardContext]:
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata, dict(extras))
    try:
        yield _current
    finally:
        _current = previous
