"""``CUDAGraphMode``, vLLM's cudagraph_mode values, in a module without torch so that
``EngineArgs`` (and with it ``kvloom --help``) loads without importing torch."""

from __future__ import annotations

import enum


class CUDAGraphMode(str, enum.Enum):
    """vLLM's cudagraph_mode values. kvloom has no piecewise compilation, so the
    PIECEWISE parts of a mode run eagerly (documented in docs/cuda_graphs.md)."""

    NONE = "NONE"
    """No CUDA graphs: every step runs eagerly."""
    PIECEWISE = "PIECEWISE"
    """Piecewise graphs (vLLM); kvloom runs them eagerly."""
    FULL = "FULL"
    """Full graphs; kvloom captures uniform decode batches, the rest runs eagerly."""
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    """Full graphs of uniform decode batches; everything else eagerly."""
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"
    """Full graphs for decode, piecewise for the rest (kvloom: the rest eagerly)."""
