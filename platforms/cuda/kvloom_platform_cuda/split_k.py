"""Split-K GEMMs in one launch: each program stores its float32 partial tile, and the last
program of a tile to finish adds the tile's partials and writes the output.

Decode-sized GEMMs (a few rows) split their K loop over programs so that the grid covers
the GPU (``kvloom.interfaces.k_splits``). Instead of a second kernel adding the partials
(one more launch per linear layer; the int4 path used torch's sum and a cast, two), an
arrival counter per output tile elects the program that adds them. In a CUDA graph on an
H200 this measured the same as the separate sum kernel (docs/benchmarks/quantization_h200.md):
the gain is one kernel fewer per layer and a sum that does not depend on launch order, not
speed. The election is CUTLASS's "serial split-K" semaphore without any program waiting:
a program stores its partial, the block synchronises, one thread increments the tile's
counter with acquire-release semantics at GPU scope, and the program that sees
``SPLIT_K - 1`` arrivals before it reads every partial (bypassing L1), writes the output
and resets the counter to zero for the next launch (so a CUDA graph replays it). The
partials are added in split order whoever arrives last.

``split_k_counters(device)`` is the one zeroed counter array of a device, allocated once
(the layers allocate it at load, before any graph capture); kernels index it by tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Output tiles one split launch may have: the counters of a device (256 KiB of int32).
MAX_SPLIT_TILES = 1 << 16

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_k_counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 arrival counters of ``device``, allocated on first use and kept (kernels
    leave them zero; CUDA graphs capture their address)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counters


@triton.jit
def store_split_k(acc, out_ptr, part_ptr, counter_ptr, offs_m, offs_n, M, N, stride_om, SPLIT_K: tl.constexpr):
    """Store the float32 tile ``acc`` (rows ``offs_m``, columns ``offs_n``) of a program of the
    grid (tiles along M, tiles along N, SPLIT_K): with one split, into ``out_ptr`` (row stride
    ``stride_om``, the output dtype); else as partial ``program_id(2)`` in ``part_ptr``
    (float32 ``[SPLIT_K, M, N]``), the tile's last program writing the sum of all partials."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        at = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + tl.program_id(2) * M * N + at, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the release below
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + tile, 0)


def split_k_buffers(
    m: int, n: int, split: int, tiles: int, device: torch.device
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(split, partials, counters)`` for a launch of ``tiles`` output tiles split ``split``
    ways: the float32 ``[split, m, n]`` partials and the device's counters. More tiles than
    the counters hold run unsplit (``split`` 1, no partials)."""
    counters = split_k_counters(device)
    if split <= 1 or tiles > MAX_SPLIT_TILES:
        return 1, counters, counters
    return split, torch.empty((split, m, n), dtype=torch.float32, device=device), counters
