"""The sampler's temperature sampling: the torch path against the CUDA platform's
``random_sample`` op (``kvloom_platform_cuda.sampling``: one Gumbel-max pass), on bf16
logits of Qwen3's vocabulary (151,936) at temperature 0.6 (nano-vllm's workload), at
batch 1, 64 and 256.

For each batch: first a correctness check of the op (``check_custom_op``: greedy rows
exact, the sampled rows' frequencies those of softmax(logits / T), at batch 8); then the
median time (``triton.testing.do_bench``: CUDA events, L2 flushed between calls) of

- ``torch_ms``: ``Sampler()`` without the op (the cast to float32, divide, softmax,
  uniform noise, log, divide, argmax), what a decode step ran before;
- ``sampler_op_ms``: ``Sampler()`` with the op active (its fast path);
- ``op_ms``: the op alone, and ``graph_ms`` the op replayed in a CUDA graph;

the speedup of the sampler, and the logits' bytes over the op's graph time next to the
measured device read bandwidth.

Writes JSON to ``--out`` (a file path). ``--device cpu`` is a smoke test: a small
vocabulary (``--vocab``), the kernel in Triton's interpreter, wall-clock timing, no graphs.

Example (GPU)::

    python benchmarks/bench_sampler.py --out "$OUT/sampler.json"
    python benchmarks/bench_sampler.py --device cpu --vocab 1000 --batches 1,2 --out /tmp/sampler_cpu.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_limits import bench, measure_read_bandwidth
from kernel_bench_cli import kernel_bench_device, kernel_bench_parser, write_result

logger = logging.getLogger("bench_sampler")

QWEN3_VOCAB = 151_936


def metadata(batch: int, temperature: float, vocab: int, device: torch.device):  # type: ignore[no-untyped-def]
    from kvloom.sample import SamplingMetadata
    from kvloom.sampling_params import SamplingParams

    return SamplingMetadata.build(
        params=[SamplingParams(temperature=temperature)] * batch,
        prompt_token_ids=[[0]] * batch,
        output_token_ids=[[]] * batch,
        generators={},
        vocab_size=vocab,
        device=device,
        eos_token_ids=[None] * batch,
    )


def check(vocab: int, dtype: torch.dtype, device: torch.device, draws: int) -> dict[str, Any]:
    from kvloom_platform_cuda.sampling import random_sample

    from kvloom.testing import check_custom_op

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(8, vocab, generator=gen)).to(dtype).to(device)
    temperature = torch.tensor([0.6, 1.0, 0.6, 1.4, 0.6, 1.0, 0.8, 0.6], device=device)
    greedy = torch.tensor([False, True, False, False, True, False, False, False], device=device)
    return check_custom_op("random_sample", random_sample, logits, temperature, greedy, draws=draws)


def measure(
    batch: int, vocab: int, dtype: torch.dtype, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    from kvloom_platform_cuda.sampling import random_sample

    from kvloom.layers.custom_ops import set_custom_ops
    from kvloom.sample import Sampler

    gen = torch.Generator().manual_seed(batch)
    logits = (3 * torch.randn(batch, vocab, generator=gen)).to(dtype).to(device)
    meta = metadata(batch, args.temperature, vocab, device)
    sampler = Sampler()
    row: dict[str, Any] = {"batch": batch, "vocab": vocab}
    set_custom_ops({})
    row["torch_ms"] = bench(lambda: sampler(logits, meta), args.warmup_ms, args.rep_ms, device)
    set_custom_ops({"random_sample": random_sample})
    try:
        row["sampler_op_ms"] = bench(lambda: sampler(logits, meta), args.warmup_ms, args.rep_ms, device)
    finally:
        set_custom_ops({})
    row["op_ms"] = bench(lambda: random_sample(logits, meta.temperature, None), args.warmup_ms, args.rep_ms, device)
    row["speedup"] = row["torch_ms"] / row["sampler_op_ms"]
    row["logits_bytes"] = logits.numel() * logits.element_size()
    if device.type == "cuda":
        random_sample(logits, meta.temperature, None)  # compiled before the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            random_sample(logits, meta.temperature, None)
        row["graph_ms"] = bench(graph.replay, args.warmup_ms, args.rep_ms, device)
        row["graph_GBps"] = row["logits_bytes"] / row["graph_ms"] / 1e6
    return row


def main() -> None:
    parser = kernel_bench_parser(__doc__, batches="1,64,256")
    parser.add_argument("--vocab", type=int, default=None, help=f"default {QWEN3_VOCAB} (1000 on the CPU)")
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()
    device = kernel_bench_device(args)  # before kvloom_platform_cuda.sampling defines its kernel
    vocab = args.vocab or (1000 if device.type == "cpu" else QWEN3_VOCAB)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "vocab": vocab, "dtype": args.dtype, "temperature": args.temperature, "rows": [],
    }  # fmt: skip
    result["check"] = check(vocab, dtype, device, draws=4000 if device.type == "cuda" else 12)
    logger.info("check_custom_op: %s", result["check"])
    if device.type == "cuda":
        result["read"] = measure_read_bandwidth(device, 1.0, args.warmup_ms, args.rep_ms)
    logger.info("%6s %10s %14s %10s %10s %8s %10s", "batch", "torch_ms", "sampler_op_ms", "op_ms", "graph_ms",
                "speedup", "graph GB/s")  # fmt: skip
    for batch in batches:
        row = measure(batch, vocab, dtype, device, args)
        result["rows"].append(row)
        logger.info("%6d %10.4f %14.4f %10.4f %10s %8.2f %10s", batch, row["torch_ms"], row["sampler_op_ms"],
                    row["op_ms"], f"{row.get('graph_ms', float('nan')):.4f}", row["speedup"],
                    f"{row.get('graph_GBps', float('nan')):.0f}")  # fmt: skip
    if "read" in result:
        logger.info("device read bandwidth %.0f GB/s", result["read"]["read_GBps"])
    write_result(args.out, result)


if __name__ == "__main__":
    main()
