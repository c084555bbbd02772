#!/usr/bin/env python3
"""Decode step time against the physical limit (issue 6, benchmark 2).

Llama-3-8B shape with random (dummy) bf16 weights, context 1024, batch 1, 16, 64, 256.
For each batch and mode (``graphs``: the default ``-O2``, i.e. full decode graphs (of a compiled
model where the platform compiles by default, as CUDA does); ``eager``; options appended with ``+``: ``+async`` for async scheduling,
``+noops`` for ``--custom-ops none``, i.e. plain torch layer math instead of the platform's
fused kernels, ``+nocompile`` for ``--no-torch-compile``: an eager model in full graphs, ``+compile`` for
``--torch-compile``, ``+tpN`` for tensor
parallelism over N GPUs, whose limit is per GPU: 1/N of the bytes), B requests with 1024-token prompts are prefilled, then the
wall time of ``--steps`` consecutive full engine steps (schedule + forward + sampling +
output processing) is taken while every request decodes; the step time is its mean (with
async scheduling a step's host work overlaps the previous step's device work, so only a
run of steps shows it). The limit is

    (weight bytes read per step + KV bytes read per step) / measured copy bandwidth

and, stricter, the same bytes over the measured read bandwidth (a large reduction)

where the weights are every matrix the step multiplies with (the embedding table is only
gathered: B rows) and the KV bytes are B x context x bytes per token.

    python benchmarks/bench_decode_roofline.py --out $OUT [--backend TRITON_ATTN]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_limits import measure_copy_bandwidth, measure_read_bandwidth
from run_spec import parse_run_spec, torch_compile_option

# Llama-3-8B
V, H, I, L, NH, NKV, HD = 128256, 4096, 14336, 32, 32, 8, 128
CONTEXT = 1024


def write_llama3_config(path: Path, quantization_config: dict[str, Any] | None = None) -> Path:
    """The Llama-3-8B config in ``path`` (dummy weights are made from it); ``quantization_config``, when
    given, declares a quantized checkpoint of that method, as a published one's config.json does."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.eos_token_id = None
    cfg.bos_token_id = None
    cfg.dtype = "bfloat16"
    if quantization_config is not None:
        cfg.quantization_config = quantization_config
    cfg.save_pretrained(path)
    return path


def bytes_per_step(batch: int, context: float, linear_bytes: float = 2.0, kv_elem_bytes: float = 2.0) -> dict[str, float]:
    """Bytes one decode step reads: the decoder's linear layers at ``linear_bytes`` per weight (a quantized
    checkpoint's, its scales included), the LM head and norms in bf16 (quantized checkpoints keep them so),
    and the KV cache at ``kv_elem_bytes`` per value; the embedding is only gathered (B rows) and ignored."""
    per_layer = H * (NH * HD) + 2 * H * (NKV * HD) + (NH * HD) * H + 3 * H * I  # qkv, o, gate+up, down
    weights = linear_bytes * L * per_layer + 2 * (V * H + L * 2 * H + H)
    kv = batch * context * L * NKV * HD * 2 * kv_elem_bytes
    return {"weight_bytes": weights, "kv_bytes": kv, "total_bytes": weights + kv}


def measure(llm: Any, batch: int, steps: int, seed: int, vocab: int = V, context: int = CONTEXT) -> dict[str, float]:
    """Mean wall time of ``steps`` engine steps while ``batch`` requests with ``context``-token
    random prompts (ids below ``vocab``) decode; the engine core must run in this process."""
    from kvloom import SamplingParams
    from kvloom.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    scheduler = engine.engine_core.core.scheduler
    g = torch.Generator().manual_seed(seed)
    # The first requests decode while the last ones still prefill (chunked prefill, one
    # step budget): they must not reach max_tokens before every request runs.
    prefill_steps = -(-batch * context // llm.config.scheduler.max_num_batched_tokens) + 1
    # FINAL_ONLY, as LLM.generate runs: the front end builds outputs only at the end.
    params = SamplingParams(
        temperature=0, max_tokens=steps + 8 + prefill_steps, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    ids = [f"b{batch}-{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    # Step until every request has its prompt computed and decodes.
    while len(scheduler.running) < batch or any(r.num_output_tokens < 2 for r in scheduler.running):
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"batch {batch}: the requests finished before all of them ran at once")
        engine.step()
    start_context = statistics.mean(r.num_tokens for r in scheduler.running)
    times = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    first = time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # returns once a step's sampled tokens are on the host
        times.append(time.perf_counter() - start)
    sync()
    total = time.perf_counter() - first
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "mean_s": total / steps,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "context": start_context + steps / 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--backend", default=None, help="Attention backend (default: selection by priority).")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--modes", default="graphs,graphs+async,eager", help="comma-separated: graphs|eager[+async][+noops][+nocompile|+compile]"
    )
    args = parser.parse_args()
    # measure() reads the scheduler between steps: the engine core runs in this process.
    os.environ.setdefault("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    copy = measure_copy_bandwidth(torch.device("cuda"), 1.0, 25, 200)
    read = measure_read_bandwidth(torch.device("cuda"), 2.0, 25, 200)
    bw = copy["copy_GBps"] * 1e9
    read_bw = read["read_GBps"] * 1e9
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "copy": copy,
        "read": read,
        "rows": [],
    }
    from kvloom import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_llama3_config(Path(tmp) / "llama3-8b-shape")
        for mode in args.modes.split(","):
            try:
                base, options, tensor_parallel_size = parse_run_spec(mode, ("async", "noops", "nocompile", "compile"))
            except ValueError as e:
                raise SystemExit(f"{e}; the mode is graphs or eager") from None
            if base not in ("graphs", "eager"):
                raise SystemExit(f"unknown mode {mode!r}: graphs or eager, optionally +async, +noops, +nocompile, +compile, +tpN")
            try:
                torch_compile = torch_compile_option(mode, options)
            except ValueError as e:
                raise SystemExit(f"mode {e}") from None
            llm = LLM(
                str(model_dir),
                load_format="dummy",
                dtype="bfloat16",
                skip_tokenizer_init=True,
                max_model_len=2048,
                max_num_seqs=max(batches),
                attention_backend=args.backend,
                enforce_eager=(base == "eager"),
                gpu_memory_utilization=0.9,
                async_scheduling="async" in options,
                custom_ops="none" if "noops" in options else None,
                torch_compile=torch_compile,
                disable_log_stats=True,  # as recorded: LLM kept stats off by default then
                tensor_parallel_size=tensor_parallel_size,
            )
            backend = llm.config.attention.backend.NAME
            for batch in batches:
                m = measure(llm, batch, args.steps, seed=batch)
                limit = bytes_per_step(batch, m["context"])
                # Under TP every GPU reads its 1/N of the weights and of the KV heads in parallel:
                # the limit is per GPU (the norms, replicated, are a few KB).
                t_limit = limit["total_bytes"] / tensor_parallel_size / bw
                t_read = limit["total_bytes"] / tensor_parallel_size / read_bw
                row = {
                    "mode": mode,
                    "backend": backend,
                    "batch": batch,
                    "tensor_parallel_size": tensor_parallel_size,
                    **m,
                    **limit,
                    "limit_s": t_limit,
                    "fraction_of_limit": t_limit / m["mean_s"],
                    "read_limit_s": t_read,
                    "fraction_of_read_limit": t_read / m["mean_s"],
                    "tok_s": batch / m["mean_s"],
                }
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                (out / "decode_roofline.json").write_text(json.dumps(result, indent=1))
            llm.llm_engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()

    print(
        f"\n== decode, Llama-3-8B shape, context {CONTEXT}, {result['gpu']}, copy {copy['copy_GBps']:.0f} GB/s, "
        f"read {read['read_GBps']:.0f} GB/s"
    )
    print(
        f"{'mode':>22} {'backend':>14} {'batch':>5} {'step ms':>8} {'limit ms':>8} {'% copy':>7} {'% read':>7} {'tok/s':>8}"
    )
    for r in result["rows"]:
        print(
            f"{r['mode']:>22} {r['backend']:>14} {r['batch']:>5} {1e3 * r['mean_s']:8.2f} {1e3 * r['limit_s']:8.2f} "
            f"{100 * r['fraction_of_limit']:6.1f}% {100 * r['fraction_of_read_limit']:6.1f}% {r['tok_s']:8.0f}"
        )


if __name__ == "__main__":
    main()
