"""Tiny Llama, Qwen3 and Qwen3-MoE fp8 checkpoints (per-tensor scales, 16x16 blocks, and
online per-channel quantization of the float checkpoint) give, in float32, the greedy
tokens of their reference: HF transformers running the dequantized weights with every
quantized GEMM's input quantized to fp8 as the scheme says (each token the reference's
choice, or within 0.1 of its logit: ``assert_greedy_matches_reference`` says why) (per token, or per token and
16 features for the block-wise checkpoint: ``kvloom.testing.quantization_reference``).

The dequantized weights come from HF's own fp8 loader for the block-wise checkpoints
(transformers dequantizes fp8 checkpoints on a machine without a GPU: an independent
reading of the format), and from this file's dequantization for the per-tensor ones (HF's
dequantizing loader reads ``weight_scale_inv`` blocks only) and for the online scheme.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from kvloom_quant_fp8 import Fp8Method
from safetensors.torch import load_file, save_file

from kvloom import LLM, SamplingParams
from kvloom.interfaces import ModelRegistry
from kvloom.testing import load_model, resolve_engine_config
from kvloom.testing.models import load_hf_model, random_prompts, tiny_model_dir
from kvloom.testing.quantization import write_quantized_checkpoint
from kvloom.testing.quantization_reference import (
    assert_greedy_matches_reference,
    hf_logits_quantized,
    reference_fp8,
)
from tests.helpers.quantized_models import kvloom_greedy

ARCHS = ("llama", "qwen3", "qwen3_moe")
BLOCK = [16, 16]
NEW_TOKENS = 12
SCHEMES = {
    "tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK, "fmt": "e4m3"},
    "online": None,
}


def dequantized_copy(src: Path, dst: Path, scheme: str) -> Path:
    """A float32 checkpoint of ``src``'s dequantized weights (``src``: the fp8 checkpoint,
    per-tensor; or the float one, quantized per channel here for the online scheme)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        scale_name = name.removesuffix("weight") + "weight_scale"
        if scheme == "tensor" and scale_name in tensors:
            tensor = tensor.float() * tensors[scale_name].float()
        elif scheme == "online" and (name.endswith("_proj.weight") and ".mlp.gate." not in name):
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
            tensor = (tensor / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
        out[name] = tensor.contiguous()
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def check_against_reference(reference_dir: Path, prompts: list[list[int]], generated: list[list[int]],
                            group: int | None) -> None:  # fmt: skip
    sequences = [p + g for p, g in zip(prompts, generated)]
    logits = hf_logits_quantized(reference_dir, sequences, functools.partial(reference_fp8, group=group))
    assert_greedy_matches_reference(prompts, generated, logits)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(arch, scheme) -> (the checkpoint kvloom loads, the float checkpoint of the reference)."""
    root = tmp_path_factory.mktemp("fp8")
    made = {}
    for arch in ARCHS:
        src = tiny_model_dir(arch)
        for scheme, config in SCHEMES.items():
            if config is None:
                made[(arch, scheme)] = (src, dequantized_copy(src, root / f"{arch}-online-ref", scheme))
                continue
            quantized = write_quantized_checkpoint(src, root / f"{arch}-{scheme}", Fp8Method(config), config)
            reference = quantized if scheme == "block" else dequantized_copy(quantized, root / f"{arch}-{scheme}-ref",
                                                                              scheme)  # fmt: skip
            made[(arch, scheme)] = (quantized, reference)
    return made


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_the_reference(checkpoints, arch: str, scheme: str) -> None:
    model_dir, reference_dir = checkpoints[(arch, scheme)]
    prompts = random_prompts(500, lengths=(5, 19, 33))
    group = BLOCK[1] if scheme == "block" else None
    generated = kvloom_greedy(model_dir, prompts, NEW_TOKENS, quantization="fp8" if scheme == "online" else None)
    check_against_reference(reference_dir, prompts, generated, group)


def test_the_block_checkpoint_dequantizes_as_transformers_reads_it(checkpoints) -> None:
    """kvloom's dequantized weights equal HF's own reading of the block-wise checkpoint."""
    model_dir, _ = checkpoints[("qwen3", "block")]
    config = resolve_engine_config(model=str(model_dir), dtype="float32")
    model = load_model(ModelRegistry.load_model_cls(config.model.architecture), config)
    hf = dict(load_hf_model(model_dir).named_parameters())
    qkv = model.model.layers[1].self_attn.qkv_proj
    expected = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.quant_method.dequantize(qkv), expected)


def test_llm_serves_an_fp8_checkpoint(checkpoints) -> None:
    """The whole engine (engine-core process, the method pickled into it) on a block-wise Qwen3-MoE."""
    model_dir, reference_dir = checkpoints[("qwen3_moe", "block")]
    prompts = random_prompts(500, lengths=(7, 21))
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, disable_log_stats=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))  # fmt: skip
    generated = [list(o.outputs[0].token_ids) for o in outs]
    assert generated == kvloom_greedy(model_dir, prompts, NEW_TOKENS)  # the engine runs what the model runs
    check_against_reference(reference_dir, prompts, generated, BLOCK[1])
