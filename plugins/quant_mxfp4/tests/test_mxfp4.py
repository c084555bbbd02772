"""MXFP4: the ``mxfp4`` method's experts and compressed-tensors' ``mxfp4-pack-quantized``
layers against their dequantized reference (the conformance kit); the formats read as
their own tools read them (transformers' gpt-oss dequantization, compressed-tensors'
decompressor); gpt-oss's stacked expert tensors loaded whole and per tensor-parallel rank;
and a tiny Qwen3-MoE with its experts written in gpt-oss's layout (stacked, gate and up
rows interleaved, ``quant_method: mxfp4``) giving, in float32, HF transformers' greedy
tokens on the weights transformers' own MXFP4 code dequantizes (gpt-oss itself comes
with the hybrid-KV issue)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kvloom_quant_compressed_tensors import CompressedTensorsMethod
from kvloom_quant_mxfp4 import GptOssFormat, Mxfp4Format, Mxfp4Method
from kvloom_quant_mxfp4.formats import BLOCK
from safetensors.torch import load_file, save_file

from kvloom.interfaces import LayerKind
from kvloom.testing.models import hf_greedy_tokens, random_prompts, tiny_model_dir
from kvloom.testing.quantization import (
    QuantizationCase,
    build_case_layer,
    check_quantization_case,
    quantization_cases,
)
from tests.helpers.quantized_models import kvloom_greedy

GPT_OSS = {"quant_method": "mxfp4",
           "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.gate", "lm_head"]}  # fmt: skip
CT_MXFP4 = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}}},
}  # fmt: skip
METHODS = {"mxfp4": Mxfp4Method(GPT_OSS), "ct-mxfp4": CompressedTensorsMethod(CT_MXFP4)}
CASES = [(name, case) for name, method in METHODS.items()
         for case in quantization_cases(method, (torch.float32,) if name == "ct-mxfp4" else None)]  # fmt: skip


@pytest.mark.parametrize(("variant", "case"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_conformance(variant: str, case) -> None:
    check_quantization_case(METHODS[variant], case)


def test_the_formats_read_as_their_tools_read_them() -> None:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvloom_quant_int4.formats import Geometry

    weight = torch.randn(40, 96) * 0.05
    geo = Geometry((40,), 96, 96)
    gpt_oss = GptOssFormat().write(weight)
    hf = convert_moe_packed_tensors(gpt_oss["blocks"][None], gpt_oss["scales"][None], dtype=torch.float32)
    assert torch.equal(GptOssFormat().read(gpt_oss, geo).dequantize(), hf[0].t())
    ct = Mxfp4Format().write(weight)
    scheme = QuantizationScheme(targets=["Linear"], **{"weights": CT_MXFP4["config_groups"]["group_0"]["weights"]})
    decompressed = MXFP4PackedCompressor.decompress(dict(ct), scheme)["weight"].float()
    assert torch.equal(Mxfp4Format().read(ct, geo).dequantize(), decompressed)
    # MXFP4's rounding keeps the weight within e2m1's precision.
    assert (decompressed - weight).norm() / weight.norm() < 0.2


def stacked(per_expert: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked tensors of whole projections ``[N, K]``, one per expert."""
    parts = [GptOssFormat().write(w) for w in per_expert]
    return {name: torch.stack([p[name] for p in parts]) for name in ("blocks", "scales")}


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1])


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
def test_stacked_experts_load_whole_and_by_rank(tp: int, rank: int) -> None:
    """The kit loads one expert's projection at a time; gpt-oss stores a layer's experts
    stacked, gate and up rows interleaved: both give the same rank weights."""
    method = METHODS["mxfp4"]
    case = QuantizationCase("experts", LayerKind.FUSED_MOE, tp_size=tp, tp_rank=rank)
    by_expert, whole = build_case_layer(method, case), build_case_layer(method, case)
    e, full, hidden = whole.num_experts, whole.full_intermediate_size, whole.hidden_size
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(e, *shape, generator=g) * 0.1 for shape in ((full, hidden),) * 2 + ((hidden, full),))
    for i in range(e):
        for kind, w in (("gate", gate[i]), ("up", up[i]), ("down", down[i])):
            proj = "w2" if kind == "down" else "w13"
            for name, t in GptOssFormat().write(w).items():
                by_expert.weight_loader(by_expert._parameters[f"{proj}_{name}"], t, f"{i}.{kind}")
    checkpoint = {"w13": stacked([interleave(gate[i], up[i]) for i in range(e)]),
                  "w2": stacked([down[i] for i in range(e)])}  # fmt: skip
    for proj, tensors in checkpoint.items():
        for name, t in tensors.items():
            assert whole.checkpoint_shards(f"{proj}_{name}") == [(f"{'gate_up' if proj == 'w13' else 'down'}_proj_{name}",
                                                                 None)]  # fmt: skip
            whole.weight_loader(whole._parameters[f"{proj}_{name}"], t, None)
    for layer in (by_expert, whole):
        layer.quant_method.process_weights_after_loading(layer)
    for a, b in zip(by_expert.quant_method.dequantize(by_expert), whole.quant_method.dequantize(whole)):
        assert torch.equal(a, b)
    inter = whole.intermediate_size
    rows = slice(rank * inter, (rank + 1) * inter)
    expected = torch.cat([gate[:, rows], up[:, rows]], dim=1)
    w13, _ = whole.quant_method.dequantize(whole)
    assert (w13 - expected).norm() / expected.norm() < 0.2


def test_a_stacked_tensor_of_the_wrong_shape_is_an_error_naming_it() -> None:
    layer = build_case_layer(METHODS["mxfp4"], QuantizationCase("experts", LayerKind.FUSED_MOE))
    with pytest.raises(ValueError, match="gate_up_proj_blocks: checkpoint tensor has shape"):
        layer.weight_loader(layer.w13_blocks, torch.zeros(3, 5, 2, BLOCK // 2, dtype=torch.uint8), None)


def gpt_oss_layout(src: Path, dst: Path) -> Path:
    """The tiny Qwen3-MoE with its experts in gpt-oss's MXFP4 layout."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    out = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    layers = sorted({n.split(".mlp.experts.")[0] for n in tensors if ".mlp.experts." in n})
    for layer in layers:
        count = len({n.split(".")[5] for n in tensors if n.startswith(layer + ".mlp.experts.")})

        def w(e: int, proj: str, layer: str = layer) -> torch.Tensor:
            return tensors[f"{layer}.mlp.experts.{e}.{proj}.weight"]

        for proj, per_expert in (("gate_up_proj", [interleave(w(e, "gate_proj"), w(e, "up_proj")) for e in range(count)]),
                                 ("down_proj", [w(e, "down_proj") for e in range(count)])):  # fmt: skip
            for name, t in stacked(per_expert).items():
                out[f"{layer}.mlp.experts.{proj}_{name}"] = t
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = GPT_OSS
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def dequantized_by_transformers(src: Path, dst: Path) -> Path:
    """The Qwen3-MoE float checkpoint of ``src``'s experts as transformers' gpt-oss code
    dequantizes them (``convert_moe_packed_tensors``: ``[E, K, N]``, gate and up columns
    interleaved)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    out = {n: t for n, t in tensors.items() if "_blocks" not in n and "_scales" not in n}
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        weights = convert_moe_packed_tensors(tensors[name], tensors[base + "_scales"], dtype=torch.float32)
        layer = base.split(".mlp.experts.")[0] + ".mlp.experts"
        for e, w in enumerate(weights):  # [K, N]
            if base.endswith("gate_up_proj"):
                out[f"{layer}.{e}.gate_proj.weight"] = w[:, 0::2].t().contiguous()
                out[f"{layer}.{e}.up_proj.weight"] = w[:, 1::2].t().contiguous()
            else:
                out[f"{layer}.{e}.down_proj.weight"] = w.t().contiguous()
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_qwen3_moe_with_gpt_oss_mxfp4_experts_gives_transformers_tokens(tmp_path: Path) -> None:
    model_dir = gpt_oss_layout(tiny_model_dir("qwen3_moe"), tmp_path / "mxfp4")
    reference = dequantized_by_transformers(model_dir, tmp_path / "reference")
    prompts = random_prompts(500, lengths=(6, 17))
    assert kvloom_greedy(model_dir, prompts, 8) == hf_greedy_tokens(reference, prompts, 8)


def test_configs_it_does_not_read_are_refused() -> None:
    with pytest.raises(ValueError, match="modules_to_not_convert: 'lm_head'"):
        Mxfp4Method({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"})
    bad = json.loads(json.dumps(CT_MXFP4))
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(ValueError, match="not supported with mxfp4-pack-quantized"):
        CompressedTensorsMethod(bad)
