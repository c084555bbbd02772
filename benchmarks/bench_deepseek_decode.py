#!/usr/bin/env python3
"""Decode steps of an MLA + MoE model (DeepSeek-V2-Lite shape) against the physical limit.

DeepSeek-V2-Lite's shape with random (dummy) bf16 weights: 27 layers, hidden 2048, 16
heads, ``kv_lora_rank`` 512, rope dim 64, the first layer dense, then 64 routed experts
(top-6) plus 2 shared experts per layer. For each batch (1, 16, 64, 256) the requests are
prefilled with ``--context``-token prompts, then the mean wall time of ``--steps`` engine
steps is taken while every request decodes (``bench_decode_roofline.measure``). The limit is

    (dense weight bytes + bytes of the experts a step touches + latent KV bytes) / copy bandwidth

where the touched experts are the expected number of distinct experts that ``batch`` tokens
choose when each picks ``top_k`` of ``E`` uniformly: ``E * (1 - (1 - k/E)**batch)`` per MoE
layer (dummy weights route close to uniformly), and the latent KV is ``batch x context x
layers x (kv_lora_rank + rope_dim)`` values. Also reported: KV capacity in tokens per GiB of
the latent cache against a standard MHA cache of the same model (per token and layer
``heads x (qk_head_dim + v_head_dim)`` values).

    python benchmarks/bench_deepseek_decode.py --out $OUT [--backend TRITON_ATTN_MLA] [--modes graphs+async,eager]
    python benchmarks/bench_deepseek_decode.py --tiny --device cpu   # a smoke run of the script on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_roofline import measure  # noqa: E402
from device_limits import measure_copy_bandwidth  # noqa: E402

# DeepSeek-V2-Lite (its config.json), the MTP-free architecture.
LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=False,
    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, max_position_embeddings=163840,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
)  # fmt: skip
# A few layers and experts: the script's own smoke test on the CPU.
TINY = LITE | dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
)  # fmt: skip


def write_config(path: Path, shape: dict[str, Any]) -> Path:
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(**shape)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    cfg.eos_token_id = None
    cfg.bos_token_id = None
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    return path


def expected_experts(batch: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts chosen by ``batch`` tokens each picking ``top_k`` of ``num_experts``."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def bytes_per_step(s: dict[str, Any], batch: int, context: float, elem: int = 2) -> dict[str, float]:
    h, nh = s["hidden_size"], s["num_attention_heads"]
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    latent = s["kv_lora_rank"] + s["qk_rope_head_dim"]
    attn = h * nh * qk + h * latent + s["kv_lora_rank"] * nh * (s["qk_nope_head_dim"] + s["v_head_dim"])
    attn += nh * s["v_head_dim"] * h
    dense_mlp = 3 * h * s["intermediate_size"]
    expert = 3 * h * s["moe_intermediate_size"]
    layers, dense_layers = s["num_hidden_layers"], s["first_k_dense_replace"]
    moe_layers = layers - dense_layers
    shared = s["n_shared_experts"] * expert + h * s["n_routed_experts"]  # shared experts + router
    touched = expected_experts(batch, s["n_routed_experts"], s["num_experts_per_tok"])
    dense_weights = elem * (layers * attn + dense_layers * dense_mlp + moe_layers * shared + s["vocab_size"] * h)
    expert_bytes = elem * moe_layers * touched * expert
    kv = elem * batch * context * layers * latent
    return {"dense_weight_bytes": dense_weights, "expert_bytes": expert_bytes, "experts_touched_per_layer": touched,
            "kv_bytes": kv, "total_bytes": dense_weights + expert_bytes + kv}  # fmt: skip


def kv_capacity(s: dict[str, Any], elem: int = 2) -> dict[str, float]:
    """Tokens per GiB of KV cache: the latent layout against a standard MHA cache."""
    layers, nh = s["num_hidden_layers"], s["num_attention_heads"]
    latent = layers * (s["kv_lora_rank"] + s["qk_rope_head_dim"]) * elem
    mha = layers * nh * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"] + s["v_head_dim"]) * elem
    return {"latent_tokens_per_gib": 2**30 / latent, "mha_tokens_per_gib": 2**30 / mha, "ratio": mha / latent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kvloom-bench"))
    parser.add_argument("--backend", default=None, help="MLA decode backend (default: selection by priority).")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", default="graphs+async,eager", help="comma-separated: graphs|eager[+async]")
    parser.add_argument("--tiny", action="store_true", help="a tiny DeepSeek-V2 instead of V2-Lite (smoke test)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    os.environ.setdefault("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # measure() reads the scheduler
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.tiny else LITE
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    copy = measure_copy_bandwidth(device, 1.0 if device.type == "cuda" else 0.05, 25, 200)
    bw = copy["copy_GBps"] * 1e9
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "copy": copy, "kv_capacity": kv_capacity(shape), "rows": [],
    }  # fmt: skip
    from kvloom import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "deepseek-v2-lite-shape", shape)
        for mode in args.modes.split(","):
            base, *options = mode.split("+")
            if base not in ("graphs", "eager") or set(options) - {"async"}:
                raise SystemExit(f"unknown mode {mode!r}: graphs or eager, optionally +async")
            kwargs: dict[str, Any] = {"gpu_memory_utilization": 0.9} if device.type == "cuda" else {}
            llm = LLM(
                str(model_dir), load_format="dummy", dtype="bfloat16" if device.type == "cuda" else "float32",
                skip_tokenizer_init=True, max_model_len=args.context + args.steps + 64, max_num_seqs=max(batches),
                attention_backend=args.backend, enforce_eager=(base == "eager"), async_scheduling="async" in options,
                disable_log_stats=True, **kwargs,
            )  # fmt: skip
            backends = {"decode": llm.config.attention.backend.NAME}
            prefill = getattr(llm.config.attention, "prefill_backend", None)
            if prefill is not None:
                backends["prefill"] = prefill.NAME
            for batch in batches:
                m = measure(llm, batch, args.steps, seed=batch, vocab=shape["vocab_size"], context=args.context)
                limit = bytes_per_step(shape, batch, m["context"], elem=2 if device.type == "cuda" else 4)
                t_limit = limit["total_bytes"] / bw
                row = {"mode": mode, "backends": backends, "batch": batch, **m, **limit, "limit_s": t_limit,
                       "fraction_of_limit": t_limit / m["mean_s"], "tok_s": batch / m["mean_s"]}  # fmt: skip
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                (out / "deepseek_decode.json").write_text(json.dumps(result, indent=1))
            llm.llm_engine.shutdown()
            del llm
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    cap = result["kv_capacity"]
    print(f"\n== decode, DeepSeek-V2-Lite shape{' (tiny)' if args.tiny else ''}, context {args.context}, "
          f"{result['gpu']}, copy {copy['copy_GBps']:.0f} GB/s")  # fmt: skip
    print(f"KV capacity: latent {cap['latent_tokens_per_gib']:.0f} tokens/GiB, MHA {cap['mha_tokens_per_gib']:.0f} "
          f"tokens/GiB ({cap['ratio']:.1f}x)")  # fmt: skip
    print(f"{'mode':>14} {'batch':>5} {'experts':>7} {'step ms':>8} {'limit ms':>8} {'% limit':>7} {'tok/s':>8}")
    for r in result["rows"]:
        print(f"{r['mode']:>14} {r['batch']:>5} {r['experts_touched_per_layer']:7.1f} {1e3 * r['mean_s']:8.2f} "
              f"{1e3 * r['limit_s']:8.2f} {100 * r['fraction_of_limit']:6.1f}% {r['tok_s']:8.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
