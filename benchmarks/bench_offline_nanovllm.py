#!/usr/bin/env python3
"""Offline throughput on nano-vllm's published workload, per attention backend.

Workload (identical to nano-vllm's bench.py): Qwen3-0.6B shape with random (dummy) bf16 weights, 256 sequences, prompt
token ids randint(0, 10000) with lengths randint(100, 1024) drawn with random.seed(0),
then output lengths randint(100, 1024) (total 133,966 output tokens), EOS ignored,
temperature 0.6, max_model_len 4096.

    python benchmarks/bench_offline_nanovllm.py --backends TRITON_ATTN,FLASHINFER --out $OUT \\
        [--hf-peer path/to/hf_peer_nanovllm_workload.py]

With ``--hf-peer`` the HF transformers continuous-batching peer runs afterwards in a child
process on the same machine, same run (its own results.json lands in OUT/hf_peer). The
byte floor (weights + KV read per decode step over the measured copy bandwidth) is
computed here too, so each number stands next to the physical limit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_limits import measure_copy_bandwidth
from run_spec import parse_run_spec, torch_compile_option

# Qwen3-0.6B
V, H, I, L, NH, NKV, HD = 151936, 1024, 3072, 28, 16, 8, 128


def workload(num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    out_lens = [random.randint(100, 1024) for _ in range(256)]
    assert sum(out_lens) == 133966, sum(out_lens)  # nano-vllm's published total
    return prompts[:num_seqs], out_lens[:num_seqs]


def write_qwen3_config(path: Path, vocab_size: int = V, **shape: int) -> Path:
    """The Qwen3-0.6B config (``vocab_size`` and ``shape``, e.g. ``hidden_size``, replace
    its sizes: a tokenizer's vocabulary, a tiny shape for a CPU check) saved in ``path``."""
    from transformers import Qwen3Config

    sizes = {"hidden_size": H, "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NH,
             "num_key_value_heads": NKV, "head_dim": HD}
    if set(shape) - set(sizes):
        raise ValueError(f"unknown Qwen3 sizes {sorted(set(shape) - set(sizes))} (allowed: {', '.join(sizes)})")
    sizes.update(shape)
    cfg = Qwen3Config(
        vocab_size=vocab_size, **sizes, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960,
        rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False, max_window_layers=sizes["num_hidden_layers"],
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.eos_token_id = None
    cfg.bos_token_id = None
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    return path


def byte_floor(prompts: list[list[int]], out_lens: list[int], copy_bps: float) -> dict[str, float]:
    """Every sequence resident at once; each decode step reads all weights once (tied
    embedding counted once, as the LM head) plus every running sequence's KV context."""
    params_layer = H * NH * HD + 2 * H * NKV * HD + NH * HD * H + 3 * H * I + 2 * H + 2 * HD
    params = V * H + L * params_layer + H
    kv_per_token = L * NKV * HD * 2 * 2
    steps = max(out_lens)
    kv_reads = sum(len(p) * o + o * (o - 1) // 2 for p, o in zip(prompts, out_lens))
    total = steps * 2 * params + kv_reads * kv_per_token
    seconds = total / copy_bps
    return {"params": params, "decode_bytes": total, "t_bytes_s": seconds, "best_tok_s": sum(out_lens) / seconds}


def timed_generate(llm: Any, prompts: list[list[int]], params: list[Any], expected_tokens: int,
                   name: str) -> tuple[float, int]:  # fmt: skip
    """Wall seconds and output tokens of one ``llm.generate`` of the whole workload, from an
    empty prefix cache; ``llm`` is kvloom's or vLLM's ``LLM`` (benchmarks/peers), the same
    call for both. A run that does not produce every expected token is an error."""
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != expected_tokens:
        raise RuntimeError(f"{name}: {tokens} output tokens, expected {expected_tokens}")
    return wall, tokens


def run_kvloom(model_dir: Path, spec: str, prompts: list[list[int]], out_lens: list[int], args: Any) -> dict[str, Any]:
    """``spec`` is a backend name with options: ``+async`` (async scheduling), ``+noops``
    (``--custom-ops none``), ``+compile`` / ``+nocompile`` (``--torch-compile`` / ``--no-torch-compile``;
    neither: the platform's default, compiled on CUDA), ``+tpN`` (tensor parallelism over N GPUs),
    e.g. ``TRITON_ATTN+async+tp2``."""
    from kvloom import LLM, SamplingParams

    backend, options, tensor_parallel_size = parse_run_spec(spec, ("async", "noops", "compile", "nocompile"))
    torch_compile = torch_compile_option(spec, options)

    start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        attention_backend=backend,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        async_scheduling="async" in options,
        disable_log_stats=True,  # as recorded: LLM kept stats off by default then
        custom_ops="none" if "noops" in options else "all",
        tensor_parallel_size=tensor_parallel_size,
        torch_compile=torch_compile,
    )
    init_s = time.perf_counter() - start
    warm = SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:8]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    wall, tokens = timed_generate(llm, prompts, params, sum(out_lens), backend)
    config = llm.config
    result = {
        "backend": spec,
        "async_scheduling": "async" in options,
        "custom_ops": "none" if "noops" in options else "all",
        "tensor_parallel_size": tensor_parallel_size,
        "torch_compile": config.compilation.compile_model,
        "block_size": config.cache.block_size,
        "num_kv_blocks": config.cache.num_blocks,
        "cudagraph_mode": config.compilation.cudagraph_mode.value,
        "enforce_eager": args.enforce_eager,
        "init_s": init_s,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "total_tok_s": (tokens + sum(map(len, prompts))) / wall,
    }
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="TRITON_ATTN",
                        help="comma-separated backend names; NAME+async: async scheduling; NAME+noops: --custom-ops none; NAME+compile / NAME+nocompile: --torch-compile / --no-torch-compile")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--hf-peer", default=None, help="Path of hf_peer_nanovllm_workload.py to run afterwards.")
    parser.add_argument("--hf-budget-s", type=float, default=420.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    prompts, out_lens = workload(args.num_seqs)
    copy = measure_copy_bandwidth(torch.device("cuda"), 1.0, 25, 200)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "workload": {"num_seqs": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(out_lens)},
        "copy": copy,
        "floor": byte_floor(prompts, out_lens, copy["copy_GBps"] * 1e9),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen3_config(Path(tmp) / "qwen3-0.6b-shape")
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            try:
                run = run_kvloom(model_dir, backend, prompts, out_lens, args)
            except Exception as e:  # report and go on with the other backends
                run = {"backend": backend, "error": repr(e)}
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
            (out / "offline_nanovllm.json").write_text(json.dumps(result, indent=1))
    if args.hf_peer:
        peer_out = out / "hf_peer"
        env = dict(os.environ, OUT=str(peer_out), HFB_BUDGET_S=str(args.hf_budget_s))
        start = time.perf_counter()
        subprocess.run([sys.executable, args.hf_peer], env=env, check=False)
        peer = json.loads((peer_out / "results.json").read_text()) if (peer_out / "results.json").exists() else {}
        main_run = peer.get("main", {})
        result["hf"] = {"tok_s": main_run.get("tok_s"), "partial": main_run.get("partial"), "attn": peer.get("attn"),
                        "wall_s": main_run.get("wall_s"), "script_s": time.perf_counter() - start}
        (out / "offline_nanovllm.json").write_text(json.dumps(result, indent=1))

    floor = result["floor"]
    print(f"\n== nano-vllm workload on {result['gpu']}: {result['workload']}")
    print(f"copy {copy['copy_GBps']:.0f} GB/s; byte floor {floor['t_bytes_s']:.2f} s -> {floor['best_tok_s']:.0f} tok/s")
    hf = result.get("hf", {}).get("tok_s")
    for run in result["runs"]:
        if "error" in run:
            print(f"{run['backend']:>16}: ERROR {run['error']}")
            continue
        vs = f", {run['output_tok_s'] / hf:.1f}x HF" if hf else ""
        print(f"{run['backend']:>16}: {run['output_tok_s']:8.0f} output tok/s ({run['wall_s']:.1f} s, block "
              f"{run['block_size']}, {100 * run['output_tok_s'] / floor['best_tok_s']:.0f}% of the byte floor{vs})")
    if hf:
        print(f"{'HF transformers':>16}: {hf:8.0f} output tok/s")


if __name__ == "__main__":
    main()
