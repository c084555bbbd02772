#!/usr/bin/env python3
"""Qwen3's q/k norms + RoPE: the CUDA platform's one kernel (``qk_norm_rotary``) against
Inductor's compilation of the same torch code (``qk_norm_rotary_torch``, which a compiled
model would run under ``--custom-ops none`` without the kept op), on the same GPU.

Qwen3-0.6B's heads (16 query + 8 key heads of 128, a strided view of the fused qkv output
[T, 4096]), bf16, for token counts of decode batches and of a 16,384-token prefill step.
Each side runs 20 times inside one CUDA graph (launch gaps as in the engine's graphs),
replayed 50 times; the time per call, and the bytes moved (heads read and written) over
it as a bandwidth.

    python benchmarks/bench_qk_norm_rotary.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvloom.layers.rotary import qk_norm_rotary_torch

Q_HEADS, K_HEADS, D = 16, 8, 128


def per_call_s(fn: Callable[[], torch.Tensor], calls: int = 20, replays: int = 50) -> float:
    """Seconds per ``fn()`` call, ``calls`` of them captured in one CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (replays * calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--tokens", default="16,64,256,2048,16384")
    args = parser.parse_args()
    from kvloom_platform_cuda.fused_ops import qk_norm_rotary

    compiled = torch.compile(qk_norm_rotary_torch, dynamic=True)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        qkv = torch.randn(tokens, (Q_HEADS + 2 * K_HEADS) * D, device="cuda", dtype=torch.bfloat16)
        heads = qkv.view(tokens, Q_HEADS + 2 * K_HEADS, D)[:, : Q_HEADS + K_HEADS]
        q_w, k_w = (1 + 0.1 * torch.randn(D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        angles = torch.rand(tokens, 1, D // 2, device="cuda") * 6
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        call = (heads, q_w, k_w, Q_HEADS, 1e-6, cos, sin)
        kernel_s = per_call_s(lambda: qk_norm_rotary(*call))
        inductor_s = per_call_s(lambda: compiled(*call))
        moved = 2 * tokens * (Q_HEADS + K_HEADS) * D * 2  # heads read + written, bf16
        rows.append({"tokens": tokens, "kernel_us": 1e6 * kernel_s, "inductor_us": 1e6 * inductor_s,
                     "kernel_gb_s": moved / kernel_s / 1e9, "inductor_gb_s": moved / inductor_s / 1e9})  # fmt: skip
    result = {"gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "shape": {"q_heads": Q_HEADS, "k_heads": K_HEADS, "head_dim": D, "dtype": "bfloat16"}, "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "qk_norm_rotary.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"== qk_norm_rotary, Qwen3-0.6B heads, bf16, {result['gpu']}")
    print(f"{'tokens':>7} {'kernel us':>10} {'Inductor us':>12} {'kernel GB/s':>12} {'Inductor GB/s':>14}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['kernel_us']:>10.2f} {r['inductor_us']:>12.2f} {r['kernel_gb_s']:>12.0f} "
              f"{r['inductor_gb_s']:>14.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
