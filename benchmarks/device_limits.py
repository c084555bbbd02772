"""Device ceilings shared by the benchmarks: copy bandwidth, read bandwidth and bf16 GEMM
rate, measured the same way everywhere (median of device-timed runs, random data).

Copy bandwidth counts read + write bytes of a tensor copy; read bandwidth counts the bytes
of a large reduction (a decode step mostly reads: weights and KV), which the H100 streams
faster than it copies, so it is the stricter limit."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def bench(fn: Callable[[], Any], warmup_ms: int, rep_ms: int, device: torch.device) -> float:
    """Median milliseconds of ``fn``: on CUDA ``do_bench`` (device events, L2 flushed
    between calls); on the CPU smoke path a few wall-clock runs."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, gib: float, warmup_ms: int, rep_ms: int) -> dict[str, float]:
    numel = int(gib * 2**30) // 2
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), warmup_ms, rep_ms, device)
    moved = 2 * src.numel() * src.element_size()  # read + write
    return {"copy_bytes": moved, "copy_ms": ms, "copy_GBps": moved / ms / 1e6}


def measure_read_bandwidth(device: torch.device, gib: float, warmup_ms: int, rep_ms: int) -> dict[str, float]:
    numel = int(gib * 2**30) // 2
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    ms = bench(lambda: src.sum(dtype=torch.float32), warmup_ms, rep_ms, device)
    read = src.numel() * src.element_size()
    return {"read_bytes": read, "read_ms": ms, "read_GBps": read / ms / 1e6}


def measure_gemm_rate(device: torch.device, n: int, warmup_ms: int, rep_ms: int) -> dict[str, float]:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, warmup_ms, rep_ms, device)
    return {"gemm_n": n, "gemm_ms": ms, "gemm_TFLOPs": 2 * n**3 / ms / 1e9}
