"""The CUDA-graph mode resolution and the dispatcher's keys: pure logic, no device."""

from __future__ import annotations

import pytest

from kvloom.attention.backend import AttentionCGSupport as S
from kvloom.cudagraph_mode import CUDAGraphMode as M
from kvloom.forward_context import BatchDescriptor
from kvloom.worker.cudagraph_dispatcher import CudagraphDispatcher, resolve_cudagraph_mode

# (requested, support, compiled) -> resolved. Written out, not derived: the table is the spec.
_FULL_DECODE_SUPPORT = (S.UNIFORM_SINGLE_TOKEN_DECODE, S.UNIFORM_BATCH, S.ALWAYS)
EXPECTED: dict[tuple[M, S, bool], M] = {}
for support in S:
    full_ok = support in _FULL_DECODE_SUPPORT
    for compiled in (False, True):
        EXPECTED[(M.NONE, support, compiled)] = M.NONE
        EXPECTED[(M.PIECEWISE, support, compiled)] = M.PIECEWISE if compiled else M.NONE
        EXPECTED[(M.FULL_DECODE_ONLY, support, compiled)] = M.FULL_DECODE_ONLY if full_ok else M.NONE
        if full_ok:
            both = M.FULL_AND_PIECEWISE if compiled else M.FULL_DECODE_ONLY
        else:
            both = M.PIECEWISE if compiled else M.NONE
        EXPECTED[(M.FULL_AND_PIECEWISE, support, compiled)] = both
        EXPECTED[(M.FULL, support, compiled)] = both  # no full graphs of mixed batches in kvloom


@pytest.mark.parametrize(("requested", "support", "compiled"), sorted(EXPECTED, key=str))
def test_resolved_mode(requested, support, compiled):
    mode, reasons = resolve_cudagraph_mode(requested, support, compiled)
    assert mode == EXPECTED[(requested, support, compiled)]
    assert bool(reasons) == (mode != requested)  # every downgrade says why
    assert resolve_cudagraph_mode(requested, support, compiled, platform_graphs=False)[0] == M.NONE


SIZES = [1, 2, 4, 8, 16, 32]


def _dispatcher(mode: M, max_num_reqs: int = 8) -> CudagraphDispatcher:
    d = CudagraphDispatcher(mode, SIZES, max_num_reqs=max_num_reqs, max_num_tokens=16)
    d.enabled = True
    return d


# (num_tokens, uniform_decode) -> expected per resolved mode: (runtime mode, padded size or None)
CASES = {
    (3, True): {M.NONE: (M.NONE, None), M.PIECEWISE: (M.PIECEWISE, 4), M.FULL_DECODE_ONLY: (M.FULL, 4),
                M.FULL_AND_PIECEWISE: (M.FULL, 4)},
    (8, True): {M.NONE: (M.NONE, None), M.PIECEWISE: (M.PIECEWISE, 8), M.FULL_DECODE_ONLY: (M.FULL, 8),
                M.FULL_AND_PIECEWISE: (M.FULL, 8)},
    # more decode requests than the largest full size (max_num_reqs 8): piecewise if any
    (12, True): {M.NONE: (M.NONE, None), M.PIECEWISE: (M.PIECEWISE, 16), M.FULL_DECODE_ONLY: (M.NONE, None),
                 M.FULL_AND_PIECEWISE: (M.PIECEWISE, 16)},
    (3, False): {M.NONE: (M.NONE, None), M.PIECEWISE: (M.PIECEWISE, 4), M.FULL_DECODE_ONLY: (M.NONE, None),
                 M.FULL_AND_PIECEWISE: (M.PIECEWISE, 4)},
    (16, False): {M.NONE: (M.NONE, None), M.PIECEWISE: (M.PIECEWISE, 16), M.FULL_DECODE_ONLY: (M.NONE, None),
                  M.FULL_AND_PIECEWISE: (M.PIECEWISE, 16)},
    # above max_num_tokens' largest size (capture sizes past 16 are dropped): no graph
    (17, False): {m: (M.NONE, None) for m in (M.NONE, M.PIECEWISE, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE)},
}  # fmt: skip


@pytest.mark.parametrize("mode", [M.NONE, M.PIECEWISE, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
@pytest.mark.parametrize("batch", sorted(CASES))
def test_dispatch(mode, batch):
    runtime, size = CASES[batch][mode]
    got = _dispatcher(mode).dispatch(*batch)
    assert got == (runtime, None if size is None else BatchDescriptor(size, runtime == M.FULL))


def test_dispatch_before_capture_and_bad_input():
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_reqs=8, max_num_tokens=16)
    assert d.dispatch(3, True) == (M.NONE, None)  # nothing captured yet
    d.enabled = True
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        d.dispatch(0, False)
    with pytest.raises(ValueError, match="resolved mode"):
        CudagraphDispatcher(M.FULL, SIZES, 8, 16)


def test_capture_keys_largest_first():
    d = _dispatcher(M.FULL_AND_PIECEWISE)
    assert d.descriptors(M.FULL) == [BatchDescriptor(s, True) for s in (8, 4, 2, 1)]
    assert d.descriptors(M.PIECEWISE) == [BatchDescriptor(s, False) for s in (16, 8, 4, 2, 1)]
    assert _dispatcher(M.FULL_DECODE_ONLY).descriptors(M.PIECEWISE) == []
    assert _dispatcher(M.PIECEWISE).descriptors(M.FULL) == []
