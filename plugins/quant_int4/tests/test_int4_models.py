"""Tiny Llama, Qwen3 and Qwen3-MoE checkpoints in AWQ (group 32) and GPTQ (act-order,
asymmetric, group 32) give, in float32, HF transformers' greedy tokens on their
dequantized weights, read here from the files by this test's own reading of the
published formats (AutoAWQ's GEMM packing; GPTQ's, with ``g_idx`` and zeros stored minus
one). gptqmodel and autoawq, the tools that write these formats, need a CUDA build and do
not install on the CPU test machine, and transformers cannot load either format without
them: the checkpoints are written to the formats' specs (``write_quantized_checkpoint``
with the methods' writers: round-to-nearest values, valid files). An AWQ checkpoint
without ``kvloom-quant-int4`` installed is refused naming the package.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kvloom_quant_int4 import AwqMethod, GptqMethod
from safetensors.torch import load_file, save_file

from kvloom.testing import resolve_engine_config
from kvloom.testing.models import hf_greedy_tokens, random_prompts, tiny_model_dir
from kvloom.testing.plugins import installed_quantization_methods
from kvloom.testing.quantization import write_quantized_checkpoint
from tests.helpers.quantized_models import kvloom_greedy

ARCHS = ("llama", "qwen3", "qwen3_moe")
NEW_TOKENS = 8
CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
             "checkpoint_format": "gptq"},
}  # fmt: skip
METHODS = {"awq": AwqMethod, "gptq": GptqMethod}


def nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit fields along ``dim``, low bits first."""
    fields = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=dim + 1)
    return fields.flatten(dim, dim + 1)


def awq_weight(tensors: dict[str, torch.Tensor], prefix: str, group: int) -> torch.Tensor:
    """AutoAWQ GEMM: qweight [K, N/8], zeros [G, N/8] with word c's field j holding output
    8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]; scales [G, N]; w = (q - z) * s, as [N, K]."""
    field_of = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # output 8c + i sits in field field_of[i]
    cols = torch.arange(tensors[prefix + "scales"].shape[1])
    index = (cols // 8) * 8 + field_of[cols % 8]
    q = nibbles(tensors[prefix + "qweight"], 1)[:, index].float()
    z = nibbles(tensors[prefix + "qzeros"], 1)[:, index].float()
    rows = torch.arange(q.shape[0]) // group
    return ((q - z[rows]) * tensors[prefix + "scales"].float()[rows]).t()


def gptq_weight(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """GPTQ: qweight [K/8, N] (input 8r + i in field i of row r), qzeros [G, N/8] holding
    zero - 1, scales [G, N], g_idx [K]; w = (q - (z + 1)) * s[g_idx], as [N, K]."""
    g_idx = tensors[prefix + "g_idx"].long()
    q = nibbles(tensors[prefix + "qweight"], 0).float()
    z = nibbles(tensors[prefix + "qzeros"], 1).float() + 1
    return ((q - z[g_idx]) * tensors[prefix + "scales"].float()[g_idx]).t()


def dequantized_copy(src: Path, dst: Path, method: str) -> Path:
    """A float32 checkpoint of ``src``'s dequantized weights (the reference HF runs)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if not name.endswith(".qweight"):
            if not name.endswith((".qzeros", ".scales", ".g_idx")):
                out[name] = tensor
            continue
        prefix = name.removesuffix("qweight")
        weight = awq_weight(tensors, prefix, 32) if method == "awq" else gptq_weight(tensors, prefix)
        out[prefix + "weight"] = weight.contiguous()
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("int4")
    made = {}
    for arch in ARCHS:
        for method, config in CONFIGS.items():
            quantized = write_quantized_checkpoint(tiny_model_dir(arch), root / f"{arch}-{method}",
                                                   METHODS[method](config), config)  # fmt: skip
            made[(arch, method)] = (quantized, dequantized_copy(quantized, root / f"{arch}-{method}-ref", method))
    return made


@pytest.mark.parametrize("method", CONFIGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(checkpoints, arch: str, method: str) -> None:
    model_dir, reference_dir = checkpoints[(arch, method)]
    tensors = load_file(model_dir / "model.safetensors")
    assert any(name.endswith(".qweight") for name in tensors) and not any(".self_attn.q_proj.weight" in n
                                                                             for n in tensors)  # fmt: skip
    if method == "gptq":  # act-order: the groups are not runs of the input features
        g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
        assert not torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=g_idx.dtype) // 32)
    prompts = random_prompts(500, lengths=(6, 17))
    generated = kvloom_greedy(model_dir, prompts, NEW_TOKENS)
    assert generated == hf_greedy_tokens(reference_dir, prompts, NEW_TOKENS)


def test_a_checkpoint_whose_method_is_not_installed_names_the_package(checkpoints) -> None:
    model_dir, _ = checkpoints[("llama", "awq")]
    with installed_quantization_methods(), pytest.raises(ValueError, match="pip install kvloom-quant-int4"):
        resolve_engine_config(model=str(model_dir), dtype="float32")
