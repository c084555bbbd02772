#!/usr/bin/env python3
"""nano-vllm's offline workload on vLLM, SGLang or kvloom, by the same code (``--engine``; SGLang through
``engines.SGLangLLM``).

The workload is imported from benchmarks/bench_offline_nanovllm.py (``workload()``: the prompts, output lengths
and seed; ``write_qwen3_config()``: the Qwen3-0.6B shape), so both engines get byte-identical prompts and the same
config: 256 sequences, prompts and outputs 100-1024 tokens, EOS ignored, temperature 0.6, dummy bf16 weights.
The procedure is kvloom's own benchmark's: start the engine (timed), warm up on 8 short prompts, reset the prefix
cache, then time ``--repeats`` full runs of the 256 sequences (prefix cache reset before each), each checked to
produce every expected output token.

    PYTHONPATH=/tmp/vsite python3 benchmarks/peers/bench_offline.py --engine vllm --out $OUT/peers/vllm_offline.json
    PYTHONPATH=/tmp/sgsite python3 benchmarks/peers/bench_offline.py --engine sglang --out $OUT/peers/sglang_offline.json
    python3 benchmarks/peers/bench_offline.py --engine kvloom --out $OUT/peers/kvloom_offline.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_offline_nanovllm import timed_generate, workload, write_qwen3_config
from engines import make_llm, run_header, sampling_params_class

log = logging.getLogger("peers.offline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="vllm, sglang or kvloom")
    parser.add_argument("--out", required=True, help="JSON file to write.")
    parser.add_argument("--repeats", type=int, default=2, help="Timed runs of the whole workload (default 2).")
    parser.add_argument("--num-seqs", type=int, default=256)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats} (allowed: >= 1)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    prompts, out_lens = workload(args.num_seqs)
    result: dict[str, Any] = {
        **run_header(args.engine, "offline"),
        "spec": {
            "num_seqs": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(out_lens),
            "temperature": 0.6,
            "ignore_eos": True,
            "model": "Qwen3-0.6B shape, dummy bf16 weights",
        },
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen3_config(Path(tmp) / "qwen3-0.6b-shape")
        llm, flags, init_s = make_llm(args.engine, model_dir, max_model_len=4096, max_num_seqs=256,
                                      max_num_batched_tokens=16384, gpu_memory_utilization=0.9)  # fmt: skip
        result["settings"], result["init_s"] = flags, init_s
        SamplingParams = sampling_params_class(args.engine)
        warm = SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:8]], warm, use_tqdm=False)
        params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
        for _ in range(args.repeats):
            wall, tokens = timed_generate(llm, prompts, params, sum(out_lens), args.engine)
            run = {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}
            log.info("%s: %.0f output tok/s (%.2f s)", args.engine, run["output_tok_s"], wall)
            result["runs"].append(run)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("engine", "version", "init_s", "runs")}), flush=True)


if __name__ == "__main__":
    main()
