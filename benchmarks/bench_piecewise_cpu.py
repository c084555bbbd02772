#!/usr/bin/env python3
"""Host cost between the pieces of the piecewise-compiled model, on the CPU.

Under PIECEWISE CUDA graphs a forward is: Dynamo's guard check, the split module's
generated code, and per layer one piece replay (``CUDAGraphWrapper``) and one eager
attention call (``torch.ops.kvloom.unified_attention`` -> the layer -> the backend impl).
On the GPU every microsecond of that host work between two graph replays is a gap on the
device. This script measures that host path on the CPU, where CUDA graphs do not exist:

- ``eager``: the model's forward without compilation (CPU_ATTN attention, real compute);
- ``compiled``: the runner's compiled forward (pieces run, no graphs);
- ``replay``: the same split model with every piece wrapped in ``CUDAGraphWrapper`` and a
  stand-in CUDA graph whose replay does nothing (capture runs the piece once and keeps its
  outputs): what remains is exactly the host path of a PIECEWISE replay, attention included;
- ``replay_noattn``: as ``replay`` with every layer's backend ``forward`` a no-op: the
  runtime's own overhead (Dynamo's entry, the outer module, wrappers, the op's dispatch);
- ``replay_noattn_no_dynamo``: the split module of ``replay_noattn`` called directly with
  the arguments Dynamo passes it: the difference is Dynamo's per-forward entry (guards).

and, per call, the parts: the attention op through ``torch.ops`` vs its Python
implementation called directly (as the split module does) vs the layer's ``run_backend``
vs the impl's ``forward`` (no-op backend), and one wrapper replay with a real piece's
arguments. A tiny Llama (hidden 64 by default, so the arithmetic is small and
the host path dominates), fp32, a uniform decode batch of ``--batch`` requests.

    python benchmarks/bench_piecewise_cpu.py --out docs/benchmarks/data [--num-layers 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("bench_piecewise_cpu")


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean wall time of ``calls`` calls, in microseconds."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: a replay launches nothing."""

    def replay(self) -> None:
        pass


class _FakeCapture:
    """Stands in for ``torch.cuda.graph(...)``: the body runs once, eagerly."""

    def __init__(self, graph: _FakeGraph, pool: Any = None) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


@contextlib.contextmanager
def fake_cuda_graphs() -> Iterator[None]:
    """CUDA graphs replaced by stand-ins; captured outputs kept alive (on the CPU a weak
    view of freed memory could be unmapped; on the GPU the graph pool keeps it)."""
    import kvloom.compilation.cuda_graph as cg

    saved = torch.cuda.CUDAGraph, torch.cuda.graph, cg.weak_ref_outputs
    torch.cuda.CUDAGraph, torch.cuda.graph, cg.weak_ref_outputs = _FakeGraph, _FakeCapture, lambda out: out
    try:
        yield
    finally:
        torch.cuda.CUDAGraph, torch.cuda.graph, cg.weak_ref_outputs = saved


@contextlib.contextmanager
def attention_noop(layers: list[Any]) -> Iterator[None]:
    """Every layer's backend ``forward`` does nothing (the host path around it stays)."""
    for layer in layers:
        layer.impl.forward = lambda q, k, v, cache, md, out: out
    try:
        yield
    finally:
        for layer in layers:
            del layer.impl.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20, help="forwards per timing sample")
    parser.add_argument("--repeats", type=int, default=7, help="timing samples (median taken)")
    parser.add_argument("--no-inductor", action="store_true", help="FX pieces instead of Inductor's")
    parser.add_argument("--label", default="", help="free text stored in the JSON (e.g. before/after)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the runner is used in-process

    from kvloom import LLM
    from kvloom.compilation import attention_op
    from kvloom.compilation.backend import PiecewiseBackend, compile_forward
    from kvloom.compilation.cuda_graph import CUDAGraphWrapper
    from kvloom.cudagraph_mode import CUDAGraphMode
    from kvloom.forward_context import BatchDescriptor, set_forward_context
    from kvloom.testing.models import make_tiny_model

    b, layers = args.batch, args.num_layers
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model("llama", Path(tmp) / "llama", num_hidden_layers=layers,
                                    hidden_size=args.hidden, intermediate_size=2 * args.hidden)  # fmt: skip
        llm = LLM(str(model_dir), dtype="float32", max_num_seqs=b, max_model_len=256, optimization_level=1,
                  torch_compile=True, use_inductor=not args.no_inductor)  # fmt: skip
    runner = llm.llm_engine.engine_core.core.worker.runner
    assert runner.compile_backend is not None and runner.model is not None
    attn = runner.attn_layers
    common = runner.inputs.dummy_metadata(np.ones(b, dtype=np.int64))  # b decode requests, no KV writes
    metadata = runner.builder.build(common)
    ids, pos = runner.inputs.input_ids[:b], runner.inputs.positions[:b]
    context = {"attn_layers": runner._attn_by_name, "num_actual_tokens": b}
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "label": args.label,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "load_avg": os.getloadavg()[0],
        "num_layers": layers, "hidden": args.hidden, "batch": b, "inductor": not args.no_inductor,
        "backend": runner.backend.NAME,
    }  # fmt: skip

    def forward(fn: Callable[..., Any], **extra: Any) -> Callable[[], Any]:
        def call() -> Any:
            with set_forward_context(metadata, **context, **extra):
                return fn(ids, pos)

        return call

    def mark_dynamic_compiled(i: torch.Tensor, p: torch.Tensor) -> Any:
        return runner.run_model(i, p)

    n, r = args.calls, args.repeats
    with torch.inference_mode():
        forwards = {"eager": forward(runner.model), "compiled": forward(mark_dynamic_compiled)}
        # The split model again, its pieces wrapped for PIECEWISE replay with stand-in graphs.
        pieces: list[CUDAGraphWrapper] = []
        captured_args: dict[int, tuple[Any, ...]] = {}  # each piece's arguments at capture

        def wrap(runnable: Any, index: int, count: int) -> CUDAGraphWrapper:
            def recording(*a: Any) -> Any:
                captured_args[index] = a
                return runnable(*a)

            pieces.append(CUDAGraphWrapper(recording, CUDAGraphMode.PIECEWISE, None, name=f"piece {index + 1}"))
            return pieces[-1]

        comp = runner.config.compilation
        backend = PiecewiseBackend(comp.splitting_ops, comp.use_inductor, wrap)
        split_args: list[Any] = []  # the split module's (flat) arguments, as Dynamo passes them

        def recording_backend(gm: Any, example_inputs: Any) -> Callable[..., Any]:
            module = backend(gm, example_inputs)

            def call(*a: Any) -> Any:
                split_args[:] = a
                return module(*a)

            return call

        replayed = compile_forward(runner.model.forward, recording_backend)

        def run_replayed(i: torch.Tensor, p: torch.Tensor) -> Any:
            torch._dynamo.mark_dynamic(i, 0)
            torch._dynamo.mark_dynamic(p, 0)
            return replayed(i, p)

        pw = {"cudagraph_runtime_mode": CUDAGraphMode.PIECEWISE, "batch_descriptor": BatchDescriptor(b, False)}
        with fake_cuda_graphs():
            forward(run_replayed, **pw)()  # compile + capture
            forwards["replay"] = forward(run_replayed, **pw)
            timings = {}
            for name, fn in forwards.items():
                timings[name] = per_call_us(fn, n, r)
            with attention_noop(attn):
                timings["replay_noattn"] = per_call_us(forward(run_replayed, **pw), n, r)
                # The split module alone, without Dynamo's entry (guards, frame swap).
                module = backend.last_split.module
                timings["replay_noattn_no_dynamo"] = per_call_us(forward(lambda i, p: module(*split_args), **pw), n, r)
            result["forward_us"] = timings
            result["per_layer_us"] = {k: v / layers for k, v in timings.items()}

            # The parts, per call.
            layer = attn[len(attn) // 2]
            q = torch.randn(b, layer.num_heads, layer.head_size)
            k = torch.randn(b, layer.num_kv_heads, layer.head_size)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            parts: dict[str, float] = {}
            with attention_noop(attn), set_forward_context(metadata, **context):
                parts["op_torch_ops_noop_backend"] = per_call_us(
                    lambda: torch.ops.kvloom.unified_attention(q, k, v, out, layer.prefix), 2000, r
                )
                # What the split module calls between two pieces (no dispatcher).
                parts["op_direct_noop_backend"] = per_call_us(
                    lambda: attention_op.unified_attention(q, k, v, out, layer.prefix), 2000, r
                )
                parts["run_backend_noop_backend"] = per_call_us(lambda: layer.run_backend(q, k, v, out), 2000, r)
                parts["impl_forward_noop"] = per_call_us(
                    lambda: layer.impl.forward(q, k, v, layer.kv_cache, metadata, out), 2000, r
                )
            with set_forward_context(metadata, **context):
                parts["run_backend_real"] = per_call_us(lambda: layer.run_backend(q, k, v, out), 200, r)
            # One replay of a middle piece with its captured arguments (same addresses).
            index = len(pieces) // 2
            middle, middle_args = pieces[index], captured_args[index]
            with set_forward_context(metadata, **context, **pw):
                parts["wrapper_replay"] = per_call_us(lambda: middle(*middle_args), 2000, r)
            parts["piece_num_args"] = len(middle_args)
            result["parts_us"] = parts
    result["num_pieces"] = len(pieces)
    logger.info(json.dumps(result, indent=1))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"cpu_piecewise_{layers}layers{'_' + args.label if args.label else ''}.json"
    (out_dir / name).write_text(json.dumps(result, indent=1) + "\n")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
