"""Tiny Llama, Qwen3 and Qwen3-MoE fp8 checkpoints (per-tensor scales, 16x16 blocks, and
online per-channel quantization of the float checkpoint) give, in float32, the greedy
tokens of their reference: HF transformers running the dequantized weights with every
quantized GEMM's input quantized to fp8 as the scheme says (per token, or per token and
16 features for the block-wise checkpoint), by hooks written here.

The dequantized weights come from HF's own fp8 loader for the block-wise checkpoints
(transformers dequantizes fp8 checkpoints on a machine without a GPU: an independent
reading of the format), and from this file's dequantization for the per-tensor ones (HF's
dequantizing loader reads ``weight_scale_inv`` blocks only) and for the online scheme.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
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
from tests.helpers.model_fixtures import PagedRunner

ARCHS = ("llama", "qwen3", "qwen3_moe")
BLOCK = [16, 16]
NEW_TOKENS = 12
SCHEMES = {
    "tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK, "fmt": "e4m3"},
    "online": None,
}


def fake_fp8(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """``x`` through fp8 e4m3 and back, one scale (amax / 448) per row or per row and ``group`` features."""
    rows = x.float().reshape(*x.shape[:-1], -1, group) if group else x.float().unsqueeze(-2)
    scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    out = (rows / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return out.reshape(x.shape).to(x.dtype)


@contextmanager
def activations_quantized(model: torch.nn.Module, group: int | None) -> Iterator[None]:
    """Inside the block, every projection's and every expert GEMM's input is quantized."""
    handles = []
    original = torch.nn.functional.linear

    def quantized_linear(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return original(fake_fp8(x, group), *args, **kwargs)

    def patch(module: torch.nn.Module, args: object) -> None:
        torch.nn.functional.linear = quantized_linear

    def restore(module: torch.nn.Module, args: object, out: object) -> None:
        torch.nn.functional.linear = original

    for name, module in model.named_modules():
        if name.endswith("_proj") and isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda m, a: (fake_fp8(a[0], group),)))
        elif name.endswith("experts"):
            handles += [module.register_forward_pre_hook(patch), module.register_forward_hook(restore)]
    try:
        yield
    finally:
        torch.nn.functional.linear = original
        for handle in handles:
            handle.remove()


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


def hf_reference_greedy(model_dir: Path, prompts: list[list[int]], group: int | None) -> list[list[int]]:
    # The eager experts call F.linear per expert (the hooks' way in); grouped_mm does not.
    model = load_hf_model(model_dir, experts_implementation="eager")
    outs = []
    with torch.no_grad(), activations_quantized(model, group):
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def kvloom_greedy(model_dir: Path, prompts: list[list[int]], quantization: str | None) -> list[list[int]]:
    config = resolve_engine_config(model=str(model_dir), dtype="float32", quantization=quantization)
    assert config.model.quantization is not None
    model = load_model(ModelRegistry.load_model_cls(config.model.architecture), config)
    runner = PagedRunner(model, config)
    outs = []
    for i, prompt in enumerate(prompts):
        tokens = [int(runner.step({i: prompt})[i][-1].argmax())]
        while len(tokens) < NEW_TOKENS:
            tokens.append(int(runner.step({i: tokens[-1:]})[i][-1].argmax()))
        outs.append(tokens)
    return outs


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
    expected = hf_reference_greedy(reference_dir, prompts, group)
    assert kvloom_greedy(model_dir, prompts, "fp8" if scheme == "online" else None) == expected


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
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_reference_greedy(reference_dir, prompts, BLOCK[1])
