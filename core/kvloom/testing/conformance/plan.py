"""Random scenario planning for the conformance suite: the request lengths and physical
blocks of each step of a case, drawn from the case's seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvloom.testing.conformance.cases import SCENARIOS, ConformanceCase
from kvloom.testing.reference import PagedRequest
from kvloom.utils import cdiv


@dataclass
class Step:
    """One step of a case: the requests the backend runs, and how the batch is padded."""

    requests: list[PagedRequest]
    #: Context already in the cache is written by the suite (True) or was written by the
    #: backend in an earlier step (False).
    prewrite_context: bool = True
    #: Token rows past num_actual_tokens that belong to no request (slot -1).
    padding_tokens: int = 0
    #: CUDA-graph filler requests (query_len 1, seq_len 1, block-table row 0, slot -1).
    filler_requests: int = 0


def _length(rng: random.Random, lo: int, hi: int, block_size: int, *, aligned: bool = False) -> int:
    """A length in [lo, hi]; a multiple of the block size when ``aligned``, otherwise
    (block sizes > 1) not one."""
    if aligned:
        return max(block_size, rng.randint(lo, hi) // block_size * block_size)
    for _ in range(100):
        n = rng.randint(lo, hi)
        if block_size == 1 or n % block_size:
            return n
    return lo if lo % block_size else lo + 1


def plan_steps(case: ConformanceCase, rng: random.Random) -> tuple[list[Step], int]:
    """The steps of one case and the number of physical blocks they need (with spares)."""
    bs = case.block_size
    # Lengths scale with the block size so contexts span several blocks. Big blocks
    # (>= 256) get fewer, shorter requests: what matters there is indexing, not length.
    small = bs < 256
    unit = max(bs, 16)
    many = 5 if small else 2
    qmax = 2 * unit if small else 48

    def length(lo: int, hi: int, aligned: bool = False) -> int:
        return _length(rng, lo, hi, bs, aligned=aligned)

    def context() -> int:  # several blocks, ending mid-block
        return length(unit, many * unit)

    def aligned_context() -> int:  # several blocks, ending on a block boundary
        return length(unit, many * unit, aligned=True)

    def crossing_context() -> int:  # ends just before a block boundary, so new tokens cross it
        return bs * rng.randint(1, 2) - rng.randint(1, min(bs, 8)) if bs > 1 else rng.randint(3, 9)

    def query(lo: int = 2) -> int:
        return length(lo, qmax)

    shapes: list[tuple[int, int]]  # (context_len, query_len) for step 1 (or the only step)
    chunks: list[int] = []
    if case.scenario == "prefill":
        shapes = [(0, length(unit + 1, many * unit if small else bs + 40)), (0, query()), (0, query())]
    elif case.scenario == "decode":
        shapes = [(context() - 1, 1), (length(2, unit) - 1, 1), (0, 1), (aligned_context() - 1, 1)]
        if small:
            shapes += [(context() - 1, 1) for _ in range(12)]
    elif case.scenario in ("long_decode", "sliding_window_long_decode"):
        shapes = [(length(1500, 2500), 1), (length(3000, 4500), 1), (context() - 1, 1)]
    elif case.scenario == "chunked_prefill":
        shapes = [(0, context()), (0, aligned_context()), (0, length(2, unit))]
        chunks = [query(), query(), query(min(unit, qmax))]
    elif case.scenario == "kv_write":
        shapes = [(crossing_context(), length(bs + 2, 2 * bs + 2) if small and bs > 1 else query(9)),
                  (0, query()), (context(), 1), (2 * bs, 1)]
    elif case.scenario in ("mixed", "padded_tokens", "sliding_window", "sinks", "soft_cap", "window_sinks"):
        shapes = [(context(), query()), (0, query()), (context() - 1, 1), (length(2, unit) - 1, 1),
                  (aligned_context(), query()), (crossing_context(), query(9))]
        if small:
            shapes += [(context() - 1, 1), (0, 1)]
    elif case.scenario == "cudagraph_padding":
        shapes = [(context() - 1, 1) for _ in range(3)] + [(0, 1)]
    else:
        raise ValueError(f"unknown scenario {case.scenario!r} (known: {', '.join(SCENARIOS)})")
    if case.scenario not in ("chunked_prefill",):
        rng.shuffle(shapes)

    total = [c + q + (chunks[i] if chunks else 0) for i, (c, q) in enumerate(shapes)]
    needed = [cdiv(t, bs) for t in total]
    num_blocks = sum(needed) + 3  # spares: blocks no request owns must stay untouched
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    requests = []
    for (ctx, q), n in zip(shapes, needed):
        requests.append(PagedRequest(ctx, q, physical[:n]))
        physical = physical[n:]

    steps = [Step(requests)]
    if chunks:
        steps = [
            Step([PagedRequest(0, r.query_len, r.blocks) for r in requests]),
            Step([PagedRequest(r.query_len, c, r.blocks) for r, c in zip(requests, chunks)], prewrite_context=False),
        ]
    elif case.scenario == "padded_tokens":
        steps[0].padding_tokens = rng.randint(3, 9)
    elif case.scenario == "kv_write":
        steps[0].padding_tokens = 4
    elif case.scenario == "cudagraph_padding":
        steps[0].filler_requests = 4
    return steps, num_blocks
