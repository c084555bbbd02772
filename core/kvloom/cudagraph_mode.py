"""``CUDAGraphMode``, vLLM's cudagraph_mode values, in a module without torch so that
``EngineArgs`` (and with it ``kvloom --help``) loads without importing torch."""

from __future__ import annotations

import enum


class CUDAGraphMode(str, enum.Enum):
    """vLLM's cudagraph_mode values (docs/cuda_graphs.md). The engine resolves the requested
    mode against the platform, the compiled model and the attention backend's support
    (``kvloom.worker.cudagraph_dispatcher.resolve_cudagraph_mode``); NONE, PIECEWISE and FULL
    are also the runtime modes of one step."""

    NONE = "NONE"
    """No CUDA graphs: every step runs without graphs (compiled or eager)."""
    PIECEWISE = "PIECEWISE"
    """Piecewise graphs of the compiled model (attention between the pieces runs eagerly)
    for every batch up to the largest capture size."""
    FULL = "FULL"
    """Full graphs; kvloom captures full graphs of uniform decode batches only, so FULL
    resolves to FULL_AND_PIECEWISE (compiled) or FULL_DECODE_ONLY."""
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    """Full graphs of uniform decode batches; everything else without graphs."""
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"
    """Full graphs for uniform decode batches, piecewise graphs for the rest."""
