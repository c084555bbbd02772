"""Which CUDA graph runs a step: the single source of truth for graph keys.

``resolve_cudagraph_mode`` turns the requested ``cudagraph_mode`` into what this engine
can do, given the platform, whether the model is compiled (piecewise graphs need the
split graph) and the attention backend's declared ``cudagraph_support``:

- full graphs of uniform decode batches (FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) need
  ``UNIFORM_SINGLE_TOKEN_DECODE`` or more; with speculative decoding, whose decode batches
  have 1 + k tokens per request (``uniform_query_len``), ``UNIFORM_BATCH`` or more;
- piecewise graphs (PIECEWISE, FULL_AND_PIECEWISE) need the compiled model; attention runs
  outside them, so every backend allows them;
- kvloom captures no full graph of a mixed batch: FULL means full decode graphs plus
  piecewise graphs for the rest when compiled (FULL_AND_PIECEWISE), else FULL_DECODE_ONLY.

``CudagraphDispatcher.dispatch`` then gives each step its runtime mode and
``BatchDescriptor``: a uniform decode batch up to the largest full-graph size runs its
FULL graph (padded to the next capture size); any other batch up to the largest
piecewise size runs PIECEWISE (padded likewise); anything else runs without graphs.
"""

from __future__ import annotations

import bisect
import logging

from kvloom.attention.backend import AttentionCGSupport
from kvloom.cudagraph_mode import CUDAGraphMode
from kvloom.forward_context import BatchDescriptor

logger = logging.getLogger(__name__)

_FULL_DECODE = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
_PIECEWISE = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


def _mode_of(full_decode: bool, piecewise: bool) -> CUDAGraphMode:
    if full_decode:
        return CUDAGraphMode.FULL_AND_PIECEWISE if piecewise else CUDAGraphMode.FULL_DECODE_ONLY
    return CUDAGraphMode.PIECEWISE if piecewise else CUDAGraphMode.NONE


def resolve_cudagraph_mode(
    requested: CUDAGraphMode,
    support: AttentionCGSupport,
    compiled: bool,
    platform_graphs: bool = True,
    uniform_query_len: int = 1,
) -> tuple[CUDAGraphMode, list[str]]:
    """The mode this engine runs for ``requested``, and why it differs (empty if it doesn't)."""
    if requested == CUDAGraphMode.NONE:
        return requested, []
    if not platform_graphs:
        return CUDAGraphMode.NONE, ["the platform has no CUDA graphs"]
    reasons = []
    full_decode = requested in _FULL_DECODE
    piecewise = requested in _PIECEWISE
    if requested == CUDAGraphMode.FULL:
        reasons.append("kvloom captures full graphs of uniform decode batches only; mixed batches run piecewise")
    if full_decode and support < AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        full_decode = False
        reasons.append(f"the attention backend supports {support.name}: no full decode graphs")
    elif full_decode and uniform_query_len > 1 and support < AttentionCGSupport.UNIFORM_BATCH:
        full_decode = False
        reasons.append(f"the attention backend supports {support.name}: no full graphs of speculative decode "
                       f"batches ({uniform_query_len} tokens per request)")  # fmt: skip
    if piecewise and not compiled:
        piecewise = False
        reasons.append("the model is not compiled: no piecewise graphs")
    return _mode_of(full_decode, piecewise), reasons


class CudagraphDispatcher:
    """Keys and runtime modes of a model runner's graphs (see the module docstring).

    ``mode`` is a resolved mode (``resolve_cudagraph_mode``); ``capture_sizes`` are token
    counts: full decode graphs are captured for those up to ``max_num_reqs`` (a decode
    batch has one token per request), piecewise graphs for those up to ``max_num_tokens``.
    With ``uniform_query_len`` q > 1 (speculative decoding) a full decode graph of r
    requests holds r x q tokens: its sizes are q times the capture sizes up to
    ``max_num_reqs`` (within ``max_num_tokens``)."""

    def __init__(
        self,
        mode: CUDAGraphMode,
        capture_sizes: list[int],
        max_num_reqs: int,
        max_num_tokens: int,
        uniform_query_len: int = 1,
    ) -> None:
        if mode == CUDAGraphMode.FULL:
            raise ValueError("CudagraphDispatcher needs a resolved mode (resolve_cudagraph_mode); got FULL")
        self.mode = mode
        sizes = sorted(set(capture_sizes))
        q = uniform_query_len
        self.full_decode_sizes = [s * q for s in sizes if s <= max_num_reqs and s * q <= max_num_tokens] \
            if mode in _FULL_DECODE else []  # fmt: skip
        self.piecewise_sizes = [s for s in sizes if s <= max_num_tokens] if mode in _PIECEWISE else []
        #: Off until the graphs are captured: every step dispatches to NONE before.
        self.enabled = False

    def descriptors(self, runtime_mode: CUDAGraphMode) -> list[BatchDescriptor]:
        """Every key to capture for ``runtime_mode``, largest first (capture order)."""
        if runtime_mode == CUDAGraphMode.FULL:
            return [BatchDescriptor(s, True) for s in reversed(self.full_decode_sizes)]
        if runtime_mode == CUDAGraphMode.PIECEWISE:
            return [BatchDescriptor(s, False) for s in reversed(self.piecewise_sizes)]
        raise ValueError(f"runtime_mode must be FULL or PIECEWISE, not {runtime_mode.value}")

    def dispatch(self, num_tokens: int, uniform_decode: bool) -> tuple[CUDAGraphMode, BatchDescriptor | None]:
        """The runtime mode and key for a step of ``num_tokens`` tokens; ``uniform_decode``:
        every request has exactly one token (1 + k with speculative decoding)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if not self.enabled:
            return CUDAGraphMode.NONE, None
        if uniform_decode and self.full_decode_sizes and num_tokens <= self.full_decode_sizes[-1]:
            size = self.full_decode_sizes[bisect.bisect_left(self.full_decode_sizes, num_tokens)]
            return CUDAGraphMode.FULL, BatchDescriptor(size, True)
        if self.piecewise_sizes and num_tokens <= self.piecewise_sizes[-1]:
            size = self.piecewise_sizes[bisect.bisect_left(self.piecewise_sizes, num_tokens)]
            return CUDAGraphMode.PIECEWISE, BatchDescriptor(size, False)
        return CUDAGraphMode.NONE, None
