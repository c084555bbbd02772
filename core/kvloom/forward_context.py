"""Per-step state that every attention layer reads during a forward pass.

The model runner wraps each forward in ``set_forward_context``; ``Attention`` layers read
the backend metadata from ``get_forward_context()``. Keeping it out of the model's
``forward`` signature lets every model class stay identical across backends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.cudagraph_mode import CUDAGraphMode


@dataclass(frozen=True)
class BatchDescriptor:
    """The key of one captured CUDA graph (``kvloom.worker.cudagraph_dispatcher`` makes it):
    the step's token count padded to a capture size, and whether the batch is a uniform
    single-token decode (full decode graphs) or not (piecewise graphs)."""

    num_tokens: int
    uniform_decode: bool


@dataclass
class ForwardContext:
    #: Backend metadata for this step (the profiling and warm-up runs build it too, from
    #: dummy requests).
    attn_metadata: Any
    #: Extra per-step data for layers (e.g. LoRA indices), keyed by feature name.
    extras: dict[str, Any] = field(default_factory=dict)
    #: The model's attention layers (``kvloom.attention.layer.Attention``) by name, for
    #: ``torch.ops.kvloom.unified_attention`` (set when the model runs compiled). Typed
    #: ``Any``: the layers read this module, which stays below them.
    attn_layers: dict[str, Any] | None = None
    #: The step's real token count when the inputs are padded to a piecewise capture size
    #: (attention runs on these rows only); None: every row is real.
    num_actual_tokens: int | None = None
    #: How CUDA graphs run this forward: NONE (no graph), PIECEWISE (the pieces' wrappers
    #: capture/replay under ``batch_descriptor``) or FULL (a full graph around the whole
    #: forward is being captured or replayed: the piece wrappers stay out of the way).
    cudagraph_runtime_mode: CUDAGraphMode | None = None
    batch_descriptor: BatchDescriptor | None = None
    #: The KV connector's per-layer calls (``kvloom.worker.kv_connector.WorkerConnector``:
    #: ``wait_for_layer_load`` before a layer's attention, ``save_kv_layer`` after it), or None.
    kv_connector: Any = None


_current: ForwardContext | None = None


def current_forward_context() -> ForwardContext | None:
    """The active context, or None outside ``set_forward_context``."""
    return _current


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: model forward must run inside set_forward_context()")
    return _current


@contextmanager
def set_forward_context(
    attn_metadata: Any,
    *,
    attn_layers: dict[str, Any] | None = None,
    num_actual_tokens: int | None = None,
    cudagraph_runtime_mode: CUDAGraphMode | None = None,
    batch_descriptor: BatchDescriptor | None = None,
    kv_connector: Any = None,
    **extras: Any,
) -> Iterator[ForwardContext]:
    global _current
    previous = _current
    _current = ForwardContext(
        attn_metadata, dict(extras), attn_layers, num_actual_tokens, cudagraph_runtime_mode, batch_descriptor,
        kv_connector,
    )
    try:
        yield _current
    finally:
        _current = previous
