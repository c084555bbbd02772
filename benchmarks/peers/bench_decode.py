#!/usr/bin/env python3
"""Decode step time at batch 1, 16 and 64 on the Llama-3-8B shape, vLLM, SGLang or kvloom, by the same code
(``--engine``; SGLang through ``engines.SGLangLLM``).

The quantity is the one of kvloom's benchmarks/bench_decode_roofline.py: the wall time of one decode step (every
request decoding one token, context about 1,024 tokens) while the batch runs, with dummy bf16 weights. That script
times engine steps from inside kvloom's engine core; vLLM's internals differ, so here the step is taken from the
public ``generate`` call alone, on both engines alike:

    step = (T(max_tokens=N2) - T(max_tokens=N1)) / (N2 - N1)

where T(n) is the wall time of one ``generate`` of ``batch`` fresh random prompts of ``--context`` tokens (ids
below the vocabulary) with greedy sampling, EOS ignored and ``max_tokens=n``. Both calls prefill the same number
of tokens and pay the same per-call costs, which cancel in the difference; what remains is N2 - N1 decode steps at
contexts ``context + N1 .. context + N2`` (their mean is recorded; bench_decode_roofline's is context + 2 + steps
/ 2). Prompts are fresh for every call (different seeds) so that the prefix cache never skips a prefill. Each T is
the median of ``--repeats`` calls. The config is bench_decode_roofline's ``write_llama3_config``.

``--quantization`` writes a quantized checkpoint's ``quantization_config`` into that config (issue 37: ``fp8``
per-tensor, ``fp8-block`` 128x128 as DeepSeek-V3 / Qwen3-FP8, ``awq`` int4 with groups of 128), so both engines
make dummy weights of that method and run their own kernels for it; ``--kv-cache-dtype fp8`` stores the KV cache
in fp8. Each row records the bytes a step reads under that config (bench_decode_roofline's ``bytes_per_step``):
quant_report.py divides them into the bf16 row's of the same engine and lease for the byte ceiling of a speed-up.

    PYTHONPATH=/tmp/vsite python3 benchmarks/peers/bench_decode.py --engine vllm --out $OUT/peers/vllm_decode.json
    PYTHONPATH=/tmp/sgsite python3 benchmarks/peers/bench_decode.py --engine sglang --out $OUT/peers/sglang_decode.json
    python3 benchmarks/peers/bench_decode.py --engine kvloom --out $OUT/peers/kvloom_decode.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode_roofline import CONTEXT, V, bytes_per_step, write_llama3_config
from engines import make_llm, run_header, sampling_params_class

log = logging.getLogger("peers.decode")

#: --quantization: the checkpoint's quantization_config and the bytes one weight of a decoder linear layer takes
#: with its scales (fp8 block: one float32 per 128x128; AWQ: 4 bits, an fp16 scale and a 4-bit zero per 128).
CHECKPOINTS: dict[str, tuple[dict[str, Any] | None, float]] = {
    "none": (None, 2.0),
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, 1.0),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                  1.0 + 4 / (128 * 128)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
            0.5 + (2 + 0.5) / 128),
}
#: --kv-cache-dtype: bytes of one stored K or V value.
KV_DTYPES = {"auto": 2.0, "fp8": 1.0}


def step_by_difference(times_short: list[float], times_long: list[float], n_short: int, n_long: int) -> float:
    """Seconds per decode step from the wall times of generate calls with ``n_short`` and ``n_long`` output
    tokens (medians of each list)."""
    if not n_long > n_short >= 1:
        raise ValueError(f"need n_long > n_short >= 1, got n_short={n_short}, n_long={n_long}")
    if not times_short or not times_long:
        raise ValueError("need at least one timing of each length")
    return (statistics.median(times_long) - statistics.median(times_short)) / (n_long - n_short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="vllm, sglang or kvloom")
    parser.add_argument("--out", required=True, help="JSON file to write.")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=CONTEXT, help=f"Prompt tokens (default {CONTEXT}).")
    parser.add_argument(
        "--short",
        type=int,
        default=16,
        help="max_tokens of the short call (N1, default 16; above the prefill chunks of a batch).",
    )
    parser.add_argument("--long", type=int, default=80, help="max_tokens of the long call (N2, default 80).")
    parser.add_argument("--repeats", type=int, default=3, help="Calls of each length; T is their median (default 3).")
    parser.add_argument("--quantization", default="none", choices=sorted(CHECKPOINTS),
                        help="The checkpoint's quantization method (default none: bf16).")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_DTYPES))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not args.long > args.short >= 1:
        parser.error(f"--short {args.short} / --long {args.long} (allowed: 1 <= short < long)")
    if args.repeats < 1 or min(batches) < 1 or args.context < 1:
        parser.error("--repeats, --batches and --context must be >= 1")
    max_model_len = max(2048, args.context + args.long)
    quantization_config, linear_bytes = CHECKPOINTS[args.quantization]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result: dict[str, Any] = {
        **run_header(args.engine, "decode"),
        "method": "generate-difference",
        "spec": {
            "model": "Llama-3-8B shape, dummy weights",
            "quantization": args.quantization,
            "quantization_config": quantization_config,
            "kv_cache_dtype": args.kv_cache_dtype,
            "context": args.context,
            "short": args.short,
            "long": args.long,
            "repeats": args.repeats,
            "mean_context": args.context + (args.short + args.long) / 2,
        },
        "rows": [],
    }
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_llama3_config(Path(tmp) / "llama3-8b-shape", quantization_config)
        kv_flag = {} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}
        llm, flags, init_s = make_llm(args.engine, model_dir, max_model_len=max_model_len, max_num_seqs=max(batches),
                                      gpu_memory_utilization=0.9, **kv_flag)  # fmt: skip
        result["settings"], result["init_s"] = flags, init_s
        SamplingParams = sampling_params_class(args.engine)
        seed = 0

        def timed(batch: int, n: int) -> float:
            nonlocal seed
            seed += 1
            rng = random.Random(seed)
            prompts = [{"prompt_token_ids": [rng.randrange(V) for _ in range(args.context)]} for _ in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            got = sum(len(o.outputs[0].token_ids) for o in outs)
            if got != batch * n:
                raise RuntimeError(f"{args.engine}: {got} output tokens, expected {batch * n}")
            return wall

        for batch in batches:
            timed(batch, args.short)  # warm-up: this batch size's graphs and kernels
            short = [timed(batch, args.short) for _ in range(args.repeats)]
            long = [timed(batch, args.long) for _ in range(args.repeats)]
            step = step_by_difference(short, long, args.short, args.long)
            reads = bytes_per_step(batch, result["spec"]["mean_context"], linear_bytes, KV_DTYPES[args.kv_cache_dtype])
            row = {"batch": batch, "step_s": step, "tok_s": batch / step, "short_s": short, "long_s": long, **reads}
            log.info("%s batch %d: %.3f ms per step", args.engine, batch, 1e3 * step)
            result["rows"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"engine": args.engine, "rows": [(r["batch"], r["step_s"]) for r in result["rows"]]}), flush=True)


if __name__ == "__main__":
    main()
