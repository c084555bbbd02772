"""Scheduler + KV cache manager overhead per decode step (no model).

N requests (default 256) with distinct prompts are admitted and prefilled, then every
step each of them decodes one token: ``schedule()`` (token budget, ``allocate_slots``,
a new block every ``block_size`` steps, block hashing for prefix caching) and
``update_from_output()`` (append, stop checks, outputs, stats). The model runner's
output is prebuilt, so the time is the scheduler's and KV manager's alone.

    python benchmarks/bench_scheduler.py [--num-requests 256] [--steps 2000]
        [--block-size 16] [--hash-algo sha256] [--no-prefix-caching]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time

from kvloom.config import CacheConfig, SchedulerConfig
from kvloom.outputs import ModelRunnerOutput
from kvloom.request import Request
from kvloom.sampling_params import SamplingParams
from kvloom.scheduler.scheduler import Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-algo", default="sha256", choices=["sha256", "sha256_cbor", "xxhash"])
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()

    n = args.num_requests
    max_model_len = args.prompt_len + args.warmup_steps + args.steps + 8
    blocks_per_request = -(-max_model_len // args.block_size)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=n,
            max_num_batched_tokens=max(8192, n),
            max_model_len=max_model_len,
            long_prefill_token_threshold=0,
            enable_chunked_prefill=True,
            policy="fcfs",
        ),
        CacheConfig(
            block_size=args.block_size,
            user_specified_block_size=True,
            gpu_memory_utilization=0.9,
            kv_cache_memory=None,
            num_gpu_blocks_override=None,
            cache_dtype="auto",
            enable_prefix_caching=not args.no_prefix_caching,
            prefix_caching_hash_algo=args.hash_algo,
        ),
        num_blocks=n * blocks_per_request + 16,
        log_stats=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_model_len, ignore_eos=True)
    for i in range(n):
        prompt = [(i * 7919 + j) % 32000 for j in range(args.prompt_len)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2))

    # Prefill everything (chunked by the token budget) until all requests decode.
    while True:
        so = scheduler.schedule()
        req_ids = list(so.num_scheduled_tokens)
        sampled = [
            [11] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
            for r in req_ids
        ]
        scheduler.update_from_output(so, ModelRunnerOutput(req_ids, sampled))
        if all(len(s) == 1 for s in sampled) and len(req_ids) == n:
            break

    decode_ids = [r.request_id for r in scheduler.running]
    runner_output = ModelRunnerOutput(decode_ids, [[11] for _ in decode_ids])
    sched_times, update_times, cpu_times = [], [], []
    gc.collect()
    if os.environ.get("BENCH_GC_FREEZE"): gc.freeze()
    for i in range(args.warmup_steps + args.steps):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        out = scheduler.update_from_output(so, runner_output)
        t2 = time.perf_counter()
        c1 = time.thread_time()
        assert so.num_reqs == n and len(out.outputs) == n
        if i >= args.warmup_steps:
            sched_times.append(t1 - t0)
            update_times.append(t2 - t1)
            cpu_times.append(c1 - c0)

    total = [a + b for a, b in zip(sched_times, update_times)]
    total_sorted = sorted(total)

    def ms(x: float) -> str:
        return f"{x * 1e3:.3f}"

    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(
        f"{n} decoding requests, block_size {args.block_size}, prefix caching "
        f"{'off' if args.no_prefix_caching else 'on (' + args.hash_algo + ')'}, {args.steps} steps"
    )
    print(f"schedule():           mean {ms(statistics.fmean(sched_times))} ms/step")
    print(f"update_from_output(): mean {ms(statistics.fmean(update_times))} ms/step")
    print(
        f"total per step:       mean {ms(statistics.fmean(total))} ms, median {ms(statistics.median(total))} ms, "
        f"p99 {ms(total_sorted[int(0.99 * (len(total) - 1))])} ms"
    )
    # CPU time of this thread: what the step costs when other processes compete for the cores.
    print(f"thread CPU per step:  mean {ms(statistics.fmean(cpu_times))} ms, median {ms(statistics.median(cpu_times))} ms")


if __name__ == "__main__":
    main()
