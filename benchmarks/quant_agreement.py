#!/usr/bin/env python3
"""Greedy agreement of quantized checkpoints with the float model they come from (issue 37).

The float model is the default model (SmolLM2-135M-Instruct's GGUF) dequantized to a float32 HF
checkpoint by transformers; the reference is kvloom on it in float32, 1,000 greedy tokens (EOS
ignored) after a chat prompt. Each candidate is that checkpoint quantized as its format says and
run by kvloom in float32 (on the CPU: the method's reference arithmetic, the same scheme as its GPU
kernels up to summation order):

* ``fp8 online``: ``--quantization fp8`` of the float checkpoint (per-channel weights, per-token
  activations);
* ``fp8 per-tensor`` and ``fp8 128x128 blocks``: ``quant_method: fp8`` checkpoints written by the
  method's format writer (dynamic activations: per token, per token and 128 features);
* ``AWQ int4`` / ``GPTQ int4``: groups of 64 (SmolLM2's 576 features are not a multiple of 128),
  round-to-nearest, written to AutoAWQ's and GPTQ's published layouts (llm-compressor and
  AutoAWQ do not install beside this transformers: a calibrated checkpoint would agree more).

Measured as ``gguf_agreement.py`` does: teacher-forced top-1 agreement at each of the reference's
positions, and the free-running first divergence and share of equal tokens.

Usage: ``python benchmarks/quant_agreement.py [--tokens 1000] [--threads 2] [--markdown F]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_agreement import chat_prompt, compare, kvloom_paths, report

from kvloom import LLM

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (method, quantization_config)
    "fp8 per-tensor (quant_method fp8)": ("fp8", FP8),
    "fp8 128x128 blocks (quant_method fp8)": ("fp8", FP8 | {"weight_block_size": [128, 128]}),
    "AWQ int4, groups of 64 (round to nearest)": ("awq", {"quant_method": "awq", "bits": 4, "group_size": 64,
                                                          "zero_point": True, "version": "gemm"}),
    "GPTQ int4, groups of 64 (round to nearest)": ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                                            "desc_act": False, "sym": True}),
}  # fmt: skip


def float_checkpoint(gguf: Path, dst: Path) -> Path:
    """The GGUF dequantized by transformers, saved as a float32 HF checkpoint with its tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: the tensors and the config, written by hand.
    dst.mkdir(parents=True)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, dst / "model.safetensors")
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(dst)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dst)
    return dst


def run(model: Path, prompt: list[int], tokens: int, reference: list[int] | None, **kwargs: Any) -> dict[str, Any]:
    llm = LLM(str(model), dtype="float32", **kwargs)
    try:
        return kvloom_paths(llm, prompt, tokens, reference)
    finally:
        llm.llm_engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--markdown", default=None, help="Append the results here (with machine, date, command).")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    from kvloom.plugins import quantization_methods
    from kvloom.testing.quantization import write_quantized_checkpoint

    default = LLM(quantization="none", dtype="float32")
    gguf = Path(default.config.model.model)
    prompt = chat_prompt(default.get_tokenizer())
    default.llm_engine.shutdown()
    del default
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = float_checkpoint(gguf, Path(tmp) / "float")
        reference = run(source, prompt, ns.tokens, None)["free"]
        rows["fp8 online (--quantization fp8)"] = compare(reference, run(source, prompt, ns.tokens, reference,
                                                                         quantization="fp8"))  # fmt: skip
        for name, (method, config) in CHECKPOINTS.items():
            dst = Path(tmp) / method / str(len(rows))
            write_quantized_checkpoint(source, dst, quantization_methods()[method](config), config)
            rows[name] = compare(reference, run(dst, prompt, ns.tokens, reference))
    report(rows, f"Greedy agreement with the float32 model: {gguf.name} dequantized, {ns.tokens} tokens", ns.markdown,
           column="checkpoint", setting="; every run float32 on the CPU")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
