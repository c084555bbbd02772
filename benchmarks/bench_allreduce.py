"""Per-message latency of the tensor-parallel all-reduce on two GPUs: NCCL
(``torch.distributed.all_reduce``, what kvloom used before) against the CUDA platform's
symmetric-memory one-shot kernel (``kvloom_platform_cuda.symm_mem_allreduce``), for
messages of ``--rows`` x ``--hidden`` elements (default bf16, 1/16/64/256/512 x 4096:
a Llama-3-8B decode step's all-reduces at those batch sizes).

Two processes, one GPU each, an NCCL group; each path is the communicator's
``all_reduce`` as the layers call it. For each size:

- ``eager_us``: the mean of ``--eager-iters`` back-to-back calls (CUDA events; includes
  the host's launch cost, which dominates small messages);
- ``graph_us``: ``--graph-calls`` (default 64, a decode step's count for 32 layers)
  calls captured in one CUDA graph, replayed ``--replays`` times; the replay time over
  the number of calls (what a captured decode step pays per all-reduce);
- ``step_saving_us``: (NCCL's graph_us - symm-mem's graph_us) x ``--graph-calls``.

Each time is the slower rank's. Writes JSON to ``--out`` (a file path).

Example (two GPUs)::

    python benchmarks/bench_allreduce.py --out "$OUT/allreduce/allreduce.json"
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench_cli import write_result

logger = logging.getLogger("bench_allreduce")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rows", default="1,16,64,256,512", help="message rows (tokens), comma-separated")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--eager-iters", type=int, default=200)
    parser.add_argument("--graph-calls", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows: {args.rows!r} is not a comma-separated list of integers")
    if min(args.rows) < 1 or args.hidden < 1 or min(args.eager_iters, args.graph_calls, args.replays) < 1:
        parser.error("--rows, --hidden, --eager-iters, --graph-calls and --replays must be >= 1")
    return args


def _elapsed_us(fn: Any, repeats: int) -> float:
    """Mean microseconds of ``fn()`` over ``repeats`` back-to-back runs, after both ranks
    lined up (a barrier) and the device drained."""
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def _time_path(reduce: Any, x: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    # The in-place NCCL path sums into its input: reduce a copy, zeroed so it stays finite.
    work = torch.zeros_like(x)
    for _ in range(10):  # warm-up (NCCL's first call on a size sets up its channels)
        reduce(work)
    eager_us = _elapsed_us(lambda: reduce(work), args.eager_iters)

    def chain() -> torch.Tensor:
        t = work
        for _ in range(args.graph_calls):
            t = reduce(t)
        return t

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.replay()
    graph_us = _elapsed_us(graph.replay, args.replays) / args.graph_calls
    return {"eager_us": eager_us, "graph_us": graph_us}


def _rank_main(rank: int, store: str, args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    os.environ["KVLOOM_ALLREDUCE"] = "symm_mem"  # the benchmark needs it: an error says why not
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2, device_id=device)
    from kvloom_platform_cuda.platform import CudaPlatform

    from kvloom.interfaces import TPCommunicator

    try:
        nccl = TPCommunicator(dist.group.WORLD, device)
        symm = CudaPlatform.make_tp_communicator(dist.group.WORLD, device)
        dtype = DTYPES[args.dtype]
        rows_out = []
        for rows in args.rows:
            x = torch.randn(rows, args.hidden, device=device).to(dtype)
            fits = getattr(symm, "fits", lambda _: False)(x)
            times = {"nccl": _time_path(nccl.all_reduce, x, args), "symm_mem": _time_path(symm.all_reduce, x, args)}
            both: list[Any] = [None, None]
            dist.all_gather_object(both, times)
            slowest = {p: {k: max(r[p][k] for r in both) for k in times[p]} for p in times}
            entry = {
                "rows": rows,
                "bytes": x.numel() * x.element_size(),
                "one_shot": fits,  # False: the symm-mem communicator sent it to NCCL too
                "nccl": slowest["nccl"],
                "symm_mem": slowest["symm_mem"],
                "graph_speedup": slowest["nccl"]["graph_us"] / slowest["symm_mem"]["graph_us"],
                "step_saving_us": (slowest["nccl"]["graph_us"] - slowest["symm_mem"]["graph_us"]) * args.graph_calls,
            }
            rows_out.append(entry)
            logger.info(
                "%4d x %d %s (%7d B, one-shot %s): NCCL eager %7.1f us graph %6.1f us | symm-mem eager %7.1f us "
                "graph %6.1f us | x%.2f, %d calls save %.0f us",
                rows, args.hidden, args.dtype, entry["bytes"], fits, slowest["nccl"]["eager_us"],
                slowest["nccl"]["graph_us"], slowest["symm_mem"]["eager_us"], slowest["symm_mem"]["graph_us"],
                entry["graph_speedup"], args.graph_calls, entry["step_saving_us"],
            )  # fmt: skip
        if rank == 0:
            write_result(args.out, {
                "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "world_size": 2,
                "dtype": args.dtype, "hidden": args.hidden, "graph_calls": args.graph_calls,
                "replays": args.replays, "eager_iters": args.eager_iters,
                "max_bytes": getattr(symm, "max_bytes", None), "results": rows_out,
            })  # fmt: skip
        symm.close()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_allreduce needs two CUDA GPUs")
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as tmp:
        mp.spawn(_rank_main, args=(os.path.join(tmp, "store"), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
