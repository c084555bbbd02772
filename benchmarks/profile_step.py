#!/usr/bin/env python3
"""Where a decode step's time goes, on a small model (where the host work shows).

The Qwen3-0.6B shape with dummy bf16 weights, ``--batch`` requests of ``--input-len``
tokens generating ``--output-len`` each, with the engine core in this process
(``KVLOOM_ENABLE_MULTIPROCESSING=0``, so one profile sees the scheduler, the model
runner and the output processing). Three measurements of the same run:

1. the wall time per step (generate's wall time over the output length);
2. ``cProfile`` of the whole run: the host functions by their own time (``tottime``) and
   by cumulative time, per step;
3. ``torch.profiler`` over ``--gpu-steps`` steps: the device's busy time per step (sum of
   the kernels), i.e. what the step would take if the host were free.

    python benchmarks/profile_step.py --out $OUT [--batch 64] [--engine-args "--attention-backend TRITON_ATTN"]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["KVLOOM_ENABLE_MULTIPROCESSING"] = "0"  # one process: one profile

import torch  # noqa: E402
from bench_offline_nanovllm import write_qwen3_config  # noqa: E402

from kvloom import LLM, SamplingParams  # noqa: E402
from kvloom.engine.arg_utils import EngineArgs  # noqa: E402
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace  # noqa: E402


def engine_kwargs(extra: str, model_dir: Path) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", str(model_dir), "--load-format", "dummy", "--dtype", "bfloat16",
                            "--max-model-len", "2048", "--skip-tokenizer-init", *shlex.split(extra)])  # fmt: skip
    args: EngineArgs = engine_args_from_namespace(ns)
    return args.model_dump(exclude_defaults=True) | {"disable_log_stats": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gpu-steps", type=int, default=20)
    parser.add_argument("--engine-args", default="--async-scheduling")
    parser.add_argument("--top", type=int, default=35)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen3_config(Path(tmp) / "qwen3-0.6b-shape")
        llm = LLM(**engine_kwargs(args.engine_args, model_dir))
        prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 9000 for j in range(args.input_len)]}
                   for i in range(args.batch)]  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
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
        for i, p in enumerate(prompts):
            engine.add_request(f"gpu-{i}", p, SamplingParams(temperature=0, max_tokens=args.gpu_steps + 40,
                                                             ignore_eos=True))  # fmt: skip
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.gpu_steps):
                engine.step()
            torch.cuda.synchronize()
            profiled_wall = time.perf_counter() - t0
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        while engine.has_unfinished_requests():
            engine.step()

    steps = args.output_len
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    result = {
        "batch": args.batch, "engine_args": args.engine_args, "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall_per_step_ms": 1000 * wall / steps,
        "profiled_wall_per_step_ms": 1000 * profiled_wall / args.gpu_steps,
        "device_busy_per_step_ms": kernel_us / 1000 / args.gpu_steps,
    }  # fmt: skip
    (out / f"profile_b{args.batch}.txt").write_text(json.dumps(result, indent=2) + "\n\n" + text.getvalue())
    print(json.dumps(result, indent=2))
    print(text.getvalue()[:12000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
