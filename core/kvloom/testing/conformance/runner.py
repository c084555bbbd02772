"""Execution of one conformance case: plan its steps, run the backend's own metadata
builder and ``AttentionImpl.forward`` on each step's paged batch (``kvloom.testing.
reference``), and collect what is wrong and the worst relative error against the float64
reference."""

from __future__ import annotations

import random
import zlib

import torch

from kvloom.attention.backend import AttentionBackend, AttentionLayerSpec
from kvloom.testing.conformance.cases import ConformanceCase
from kvloom.testing.conformance.outcome import Outcome
from kvloom.testing.conformance.plan import plan_steps
from kvloom.testing.reference import PagedCache, check_paged_case, run_paged_case


def case_seed(seed: int, case: ConformanceCase) -> int:
    """The data seed of ``case`` in a run seeded ``seed``."""
    return zlib.crc32(f"{seed}:{case.name}".encode())


def run_steps(backend: type[AttentionBackend], case: ConformanceCase, device: torch.device, seed: int) -> Outcome:
    """Run ``case`` with data drawn from ``seed`` (see ``case_seed``); backend errors
    propagate."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    steps, num_blocks = plan_steps(case, rng)
    spec = AttentionLayerSpec(
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        dtype=case.dtype,
        kv_cache_dtype=case.dtype,
        block_size=case.block_size,
        max_num_seqs=max(len(s.requests) + s.filler_requests for s in steps),
        max_model_len=max(r.seq_len for s in steps for r in s.requests),
        scale=case.scale,
        sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap,
    )
    cache = PagedCache.allocate(backend, spec, num_blocks, device, generator, fill="random", sinks=case.sinks)
    max_blocks = max(len(r.blocks) for s in steps for r in s.requests) + 1
    builder = cache.make_builder(max_blocks)
    impl = cache.make_impl()

    outcome = Outcome()
    for index, step in enumerate(steps):
        where = f"step {index + 1}/{len(steps)}: " if len(steps) > 1 else ""
        paged = cache.step(
            step.requests,
            padding_tokens=step.padding_tokens,
            filler_requests=step.filler_requests,
            prewrite_context=step.prewrite_context,
            max_blocks=max_blocks,
        )
        check = check_paged_case(paged, run_paged_case(paged, builder=builder, impl=impl))
        outcome.problems += [where + p for p in check.problems]
        for i, (request, err) in enumerate(zip(paged.requests, check.request_errors)):
            if not err <= outcome.worst:  # also catches NaN
                outcome.worst = err
                outcome.worst_where = f"{where}request {i} (context {request.context_len}, query {request.query_len})"
    return outcome
