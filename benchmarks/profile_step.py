#!/usr/bin/env python3
"""Where a decode step's time goes, on a small model (where the host work shows).

The Qwen3-0.6B shape (``--shape llama3-8b``: the Llama-3-8B shape of
``bench_decode_roofline.py``) with dummy bf16 weights, ``--batch`` requests of ``--input-len``
tokens generating ``--output-len`` each, with the engine core in this process
(``KVLOOM_ENABLE_MULTIPROCESSING=0``, so one profile sees the scheduler, the model
runner and the output processing). Three measurements of the same run:

1. the wall time per step (generate's wall time over the output length);
2. ``cProfile`` of the whole run: the host functions by their own time (``tottime``) and
   by cumulative time, per step;
3. ``torch.profiler`` over ``--gpu-steps`` steps: the device's busy time per step (sum of
   the kernels), i.e. what the step would take if the host were free and the kernels ran
   back to back, and the kernels and copies per step (each adds a launch gap).

    python benchmarks/profile_step.py --out $OUT [--batch 64] [--engine-args "--attention-backend TRITON_ATTN"]

``--host-only`` measures the engine loop's host work on the CPU instead: a tiny model of the
same vocabulary (hidden 64, 2 layers, fp32, one torch thread), so the forward is small and
what remains of a decode step is the scheduler, input preparation, sampling setup, the
hand-off of tokens and output processing. It times ``--steps`` decode steps of
``engine.step()`` (every request decoding, prefill done) ``--repeats`` times and reports
the best and the median per step of the wall time, of the host time (the wall time less
the model runner's forward, LM head and sampler calls, timed around them) and of the
engine core's host time (the same within ``EngineCore.step``: without the output
processing, which runs in another process unless ``KVLOOM_ENABLE_MULTIPROCESSING=0``),
and the attention backend's metadata build within them (the CPU backend's own host work),
then a cProfile of one more stretch. Requests use FINAL_ONLY outputs, as ``LLM.generate``. Use a small ``--vocab-size``: on the CPU the LM head and
the argmax over a real vocabulary cost tens of ms per step, and no host code depends on
it for greedy decoding.

    python benchmarks/profile_step.py --host-only --batch 64 --input-len 128 --vocab-size 1024 --out DIR

``--prefill`` profiles prefill steps instead: ``--batch`` prompts of ``--input-len`` tokens
with one output token each (16 x 1024 fills the nano-vllm workload's 16,384-token budget in one
step), timed three times (wall per ``generate``) and then profiled once, with the step's
projection FLOPs at the GEMM rate as its yardstick.

    python benchmarks/profile_step.py --prefill --batch 16 --input-len 1024 --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["KVLOOM_ENABLE_MULTIPROCESSING"] = "0"  # one process: one profile

import torch  # noqa: E402
from bench_decode_roofline import write_llama3_config  # noqa: E402
from bench_offline_nanovllm import HD, NH, NKV, H, I, L, V, write_qwen3_config  # noqa: E402

from kvloom import LLM, SamplingParams  # noqa: E402
from kvloom.sampling_params import RequestOutputKind  # noqa: E402
from kvloom.utils import freeze_gc_heap  # noqa: E402
from kvloom.engine.arg_utils import EngineArgs  # noqa: E402
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace  # noqa: E402


def engine_kwargs(extra: str, model_dir: Path, dtype: str = "bfloat16") -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", str(model_dir), "--load-format", "dummy", "--dtype", dtype,
                            "--max-model-len", "2048", "--skip-tokenizer-init", *shlex.split(extra)])  # fmt: skip
    args: EngineArgs = engine_args_from_namespace(ns)
    return args.model_dump(exclude_defaults=True) | {"disable_log_stats": True}


#: The tiny shape of ``--host-only``: the forward costs little next to the host work.
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32}  # fmt: skip


def decode_steps(engine: object, batch: int, input_len: int, steps: int, tag: str, vocab_size: int) -> None:
    """Add ``batch`` requests that decode for more than ``steps`` steps and run their
    prefill, leaving every request decoding. Their prompts differ from the first token
    on (no prefix-cache hits between them)."""
    for i in range(batch):
        prompt = {"prompt_token_ids": [1 + (131 * i + 7 * j) % (vocab_size - 1) for j in range(input_len)]}
        params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate: no output per step
        engine.add_request(f"{tag}-{i}", prompt, params)  # type: ignore[attr-defined]
    for _ in range(16):  # prefill (chunked by the token budget) and the first decode steps
        engine.step()  # type: ignore[attr-defined]


class Clock:
    """Seconds spent in the wrapped calls (``wrap``), added up."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def clocks(engine: Any) -> tuple[Clock, Clock, Clock]:
    """Clocks around (1) the model runner's forward, LM head and sampler (the model's own
    work: the wall time less this is host work), (2) the engine core's step (its host
    work is this less (1); the rest, the output processing, runs in the front-end process
    when the engine core has its own) and (3) the attention backend's metadata build (host
    work of the backend's own: the CPU backend's differs from the GPU backends')."""
    core = engine.engine_core.core
    runner = core.executor.driver_worker.model_runner
    model, core_step, attn_build = Clock(), Clock(), Clock()
    runner.run_model = model.wrap(runner.run_model)
    runner.model.compute_logits = model.wrap(runner.model.compute_logits)
    runner.sampler.sampler = model.wrap(runner.sampler.sampler)
    core.step = core_step.wrap(core.step)
    runner.builder.build = attn_build.wrap(runner.builder.build)
    return model, core_step, attn_build


def drain(engine: object) -> None:
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]


def host_only(args: argparse.Namespace, out: Path) -> int:
    """The ``--host-only`` measurement (see the module docstring)."""
    torch.set_num_threads(1)
    os.environ.setdefault("KVLOOM_CPU_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen3_config(Path(tmp) / "qwen3-tiny", vocab_size=args.vocab_size, **TINY_SHAPE)
        kwargs = engine_kwargs(args.engine_args, model_dir, dtype="float32") | {"max_num_seqs": max(256, args.batch)}
        engine = LLM(**kwargs).llm_engine
        freeze_gc_heap()  # as the engine core's own process does after start-up
        model, core_step, attn_build = clocks(engine)
        walls, hosts, core_hosts, builds = [], [], [], []
        for r in range(args.repeats):
            decode_steps(engine, args.batch, args.input_len, args.steps, f"t{r}", args.vocab_size)
            model.seconds = core_step.seconds = attn_build.seconds = 0.0
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            wall = time.perf_counter() - start
            walls.append(wall / args.steps)
            hosts.append((wall - model.seconds) / args.steps)
            core_hosts.append((core_step.seconds - model.seconds) / args.steps)
            builds.append(attn_build.seconds / args.steps)
            drain(engine)
            engine.reset_prefix_cache()

        decode_steps(engine, args.batch, args.input_len, args.steps, "prof", args.vocab_size)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        profiler.disable()
        drain(engine)

    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    profiled_s = stats.total_tt  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    result = {
        "batch": args.batch, "engine_args": args.engine_args, "device": "cpu (--host-only, 1 torch thread)",
        "vocab_size": args.vocab_size, "shape": TINY_SHAPE, "steps": args.steps, "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": platform.processor() or platform.machine(),
        "wall_per_step_ms_best": 1000 * min(walls),
        "wall_per_step_ms_median": 1000 * statistics.median(walls),
        "host_per_step_ms_best": 1000 * min(hosts),
        "host_per_step_ms_median": 1000 * statistics.median(hosts),
        "core_host_per_step_ms_best": 1000 * min(core_hosts),
        "core_host_per_step_ms_median": 1000 * statistics.median(core_hosts),
        "attention_build_per_step_ms_median": 1000 * statistics.median(builds),
        "profiled_wall_per_step_ms": 1000 * profiled_s / args.steps,
    }  # fmt: skip
    (out / f"host_step_b{args.batch}.txt").write_text(json.dumps(result, indent=2) + "\n\n" + text.getvalue())
    print(json.dumps(result, indent=2))
    print(text.getvalue()[:12000])
    return 0


def prefill_only(args: argparse.Namespace, out: Path) -> int:
    """The ``--prefill`` measurement (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen3_config(Path(tmp) / "qwen3-0.6b-shape")
        llm = LLM(**engine_kwargs(args.engine_args, model_dir) | {"max_num_batched_tokens": 16384})
        freeze_gc_heap()
        prompts = [{"prompt_token_ids": [100 + (7 * i + 3 * j) % 9000 for j in range(args.input_len)]}
                   for i in range(args.batch)]  # fmt: skip
        params = SamplingParams(temperature=args.temperature, max_tokens=1, ignore_eos=True)
        walls = []
        for _ in range(4):  # the first is a warm-up (new shapes: autotuning, Inductor's kernels)
            llm.llm_engine.reset_prefix_cache()
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
        llm.llm_engine.reset_prefix_cache()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        device_ops = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        busy_ms = sum(e.self_device_time_total for e in device_ops) / 1000
        kernels = prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top)
    tokens = args.batch * args.input_len
    projection_flops = 2 * tokens * L * (H * (NH + 2 * NKV) * HD + NH * HD * H + 3 * H * I)
    result = {
        "prefill_tokens": tokens, "batch": args.batch, "input_len": args.input_len, "engine_args": args.engine_args,
        "gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall_ms": [1000 * w for w in walls[1:]], "warmup_wall_ms": 1000 * walls[0], "device_busy_ms": busy_ms,
        "device_ops": sum(e.count for e in device_ops), "projection_tflop": projection_flops / 1e12,
    }  # fmt: skip
    (out / f"prefill_{args.batch}x{args.input_len}.txt").write_text(json.dumps(result, indent=2) + "\n\n" + kernels)
    print(json.dumps(result, indent=2))
    print(kernels)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gpu-steps", type=int, default=20)
    parser.add_argument("--engine-args", default="--async-scheduling")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the profiled requests (0: greedy; nano-vllm's workload uses 0.6)")
    parser.add_argument("--shape", default="qwen3-0.6b", choices=["qwen3-0.6b", "llama3-8b"],
                        help="the decode profile's model shape (dummy bf16 weights)")
    parser.add_argument("--prefill", action="store_true", help="profile prefill steps instead (see above)")
    parser.add_argument("--host-only", action="store_true", help="the host work on the CPU, tiny model (see above)")
    parser.add_argument("--steps", type=int, default=200, help="--host-only: decode steps per timed stretch")
    parser.add_argument("--repeats", type=int, default=3, help="--host-only: timed stretches")
    parser.add_argument("--vocab-size", type=int, default=V, help="--host-only: the tiny model's vocabulary")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.host_only:
        return host_only(args, out)
    if args.prefill:
        return prefill_only(args, out)
    with tempfile.TemporaryDirectory() as tmp:
        extra = {}
        if args.shape == "llama3-8b":  # as bench_decode_roofline.py runs it
            model_dir = write_llama3_config(Path(tmp) / "llama3-8b-shape")
            extra = {"max_num_seqs": args.batch}
        else:
            model_dir = write_qwen3_config(Path(tmp) / "qwen3-0.6b-shape")
        llm = LLM(**engine_kwargs(args.engine_args, model_dir) | extra)
        freeze_gc_heap()  # as the engine core's own process does after start-up
        prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 9000 for j in range(args.input_len)]}
                   for i in range(args.batch)]  # fmt: skip
        params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        llm.llm_engine.reset_prefix_cache()

        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        llm.llm_engine.reset_prefix_cache()

        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        profiler.disable()
        llm.llm_engine.reset_prefix_cache()

        # Device time: profile a decode-only stretch (prefill done, every request decoding).
        engine = llm.llm_engine
        # Enough steps for every prompt's prefill (its chunks) and a few decodes after it.
        budget = llm.config.scheduler.max_num_batched_tokens
        warm_steps = -(-args.batch * args.input_len // budget) + 5
        for i, p in enumerate(prompts):
            engine.add_request(f"gpu-{i}", p, SamplingParams(temperature=args.temperature,
                                                             max_tokens=args.gpu_steps + warm_steps + 10,
                                                             ignore_eos=True))  # fmt: skip
        for _ in range(warm_steps):
            engine.step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.gpu_steps):
                engine.step()
            torch.cuda.synchronize()
            profiled_wall = time.perf_counter() - t0
        device_ops = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        kernel_us = sum(e.self_device_time_total for e in device_ops)
        # Kernels and copies the device ran (graph nodes count one each): at small batches
        # each costs ~1 us of launch gap on top of its own time, which "busy" omits.
        device_launches = sum(e.count for e in device_ops)
        kernels = prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top)
        while engine.has_unfinished_requests():
            engine.step()

    steps = args.output_len
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    result = {
        "batch": args.batch, "shape": args.shape, "engine_args": args.engine_args,
        "gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall_per_step_ms": 1000 * wall / steps,
        "profiled_wall_per_step_ms": 1000 * profiled_wall / args.gpu_steps,
        "device_busy_per_step_ms": kernel_us / 1000 / args.gpu_steps,
        "device_ops_per_step": device_launches / args.gpu_steps,
    }  # fmt: skip
    (out / f"profile_{args.shape}_b{args.batch}.txt").write_text(json.dumps(result, indent=2) + "\n\n" + kernels + "\n\n" + text.getvalue())
    print(json.dumps(result, indent=2))
    print(kernels)
    print(text.getvalue()[:12000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
