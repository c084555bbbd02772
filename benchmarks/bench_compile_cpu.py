#!/usr/bin/env python3
"""Decode step time on the CPU: eager vs torch.compile (Inductor's C++ backend) (issue 19).

SmolLM2-135M shape (hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab 49152) with random
(dummy) fp32 weights and ``--num-layers`` layers (30 in the model). B requests with
``--context``-token prompts are prefilled, then the median wall time of ``--steps`` decode
engine steps is taken, for each batch in ``--batches``, eager (-O0) and compiled
(``--torch-compile``, -O1). The compiled run's tokens are checked against eager's (greedy,
fp32). Startup times (compile included) are reported too.

    python benchmarks/bench_compile_cpu.py --out docs/benchmarks [--num-layers 30]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def write_config(path: Path, layers: int) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.1)  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.eos_token_id = cfg.bos_token_id = None
    cfg.save_pretrained(path)
    return path


def measure(llm: Any, batch: int, context: int, steps: int) -> dict[str, Any]:
    from kvloom import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.core.scheduler
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, {"prompt_token_ids": torch.randint(0, 49152, (context,), generator=g).tolist()},
                           params)  # fmt: skip
    while len(scheduler.running) < batch or any(r.num_output_tokens < 2 for r in scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    tokens = {r.request_id: list(r.output_token_ids) for r in scheduler.running}
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {"median_s": statistics.median(times), "min_s": min(times), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the scheduler is read between steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                              "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                              "num_layers": args.num_layers, "context": args.context, "rows": []}  # fmt: skip
    from kvloom import LLM

    tokens: dict[str, dict[int, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "smollm2-135m-shape", args.num_layers)
        for mode, kwargs in (("eager", {"optimization_level": 0}),
                             ("compiled", {"optimization_level": 1, "torch_compile": True})):  # fmt: skip
            start = time.perf_counter()
            llm = LLM(str(model_dir), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
                      max_model_len=args.context + args.steps + 16, max_num_seqs=max(batches),
                      kv_cache_memory="1GiB", disable_log_stats=True, **kwargs)  # fmt: skip
            # Compile happens in the first forwards (warm-up, then the first 1-token step).
            for batch in batches:
                m = measure(llm, batch, args.context, args.steps)
                tokens.setdefault(mode, {})[batch] = sorted(m.pop("tokens").values())
                row = {"mode": mode, "batch": batch, **m}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            result.setdefault("startup_and_run_s", {})[mode] = time.perf_counter() - start
            llm.llm_engine.shutdown()
            del llm
            torch._dynamo.reset()
            gc.collect()
    result["compiled_tokens_identical"] = tokens["eager"] == tokens["compiled"]
    (out / "compile_cpu.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
