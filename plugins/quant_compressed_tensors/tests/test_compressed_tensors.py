"""compressed-tensors checkpoints written by the ``compressed-tensors`` library itself (the
compressor llm-compressor saves with) load and give, in float32, the greedy tokens of HF
transformers on the same file (transformers + compressed-tensors decompress it on the
CPU) with fp8 activation quantization added as the scheme says (each token the reference's
choice or within 0.1 of its logit: ``assert_greedy_matches_reference``); the method's layers pass
the conformance kit; what it does not read is refused naming the field.

HF 5 keeps an MoE's experts as one 3D parameter, not ``Linear`` modules, so the tool
leaves Qwen3-MoE's experts float: that checkpoint's ``ignore`` gains them (the router is
ignored as llm-compressor's recipes do); the kit covers quantized experts.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from kvloom_quant_compressed_tensors import CompressedTensorsMethod

from kvloom.testing.models import random_prompts, tiny_model_dir
from kvloom.testing.quantization import check_quantization_case, quantization_cases
from kvloom.testing.quantization_reference import (
    assert_greedy_matches_reference,
    hf_logits_quantized,
    reference_fp8,
)
from tests.helpers.quantized_models import kvloom_greedy

ct = pytest.importorskip("compressed_tensors")

NEW_TOKENS = 12
ARCHS = ("llama", "qwen3", "qwen3_moe")
FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
SCHEMES = {
    # llm-compressor's FP8_DYNAMIC preset: per-channel weights, dynamic per-token activations.
    "channel": {"weights": {**FP8, "strategy": "channel", "dynamic": False},
                "input_activations": {**FP8, "strategy": "token", "dynamic": True}},
    # FP8_BLOCK with a 16x16 block (the tiny dims divide it): per-group activations.
    "block": {"weights": {**FP8, "strategy": "block", "dynamic": False, "block_structure": [16, 16]},
              "input_activations": {**FP8, "strategy": "group", "dynamic": True, "group_size": 16}},
}  # fmt: skip


def write_with_compressed_tensors(src: Path, dst: Path, scheme: dict) -> Path:
    """Quantize the tiny HF checkpoint ``src`` with the compressed-tensors library (weight
    scales from its own ``calculate_qparams``) and save it compressed, as llm-compressor does."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                ignore=["lm_head", "re:.*mlp.gate$"], format="float-quantized")  # fmt: skip
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.data
        if args.strategy == "block":
            bo, bi = args.block_structure
            tiles = w.reshape(w.shape[0] // bo, bo, w.shape[1] // bi, bi)
            lo, hi = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
        else:
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        scale, _ = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())
    if "moe" in src.name:
        config_file = dst / "config.json"
        data = json.loads(config_file.read_text())
        data["quantization_config"]["ignore"].append("re:.*mlp\\.experts\\..*")
        config_file.write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("compressed-tensors")
    return {(arch, name): write_with_compressed_tensors(tiny_model_dir(arch), root / f"{arch}-{name}", scheme)
            for arch in ARCHS for name, scheme in SCHEMES.items()}  # fmt: skip


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_on_the_same_file(checkpoints, arch: str, scheme: str) -> None:
    from transformers import CompressedTensorsConfig

    model_dir = checkpoints[(arch, scheme)]
    assert json.loads((model_dir / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
    prompts = random_prompts(500, lengths=(6, 27))
    quantize = functools.partial(reference_fp8, group=16 if scheme == "block" else None)
    generated = kvloom_greedy(model_dir, prompts, NEW_TOKENS)
    logits = hf_logits_quantized(model_dir, [p + g for p, g in zip(prompts, generated)], quantize,
                                 quantization_config=CompressedTensorsConfig(run_compressed=False))  # fmt: skip
    assert_greedy_matches_reference(prompts, generated, logits)


KIT_CONFIGS = {
    "channel-token": SCHEMES["channel"],
    "block-group": {"weights": {**FP8, "strategy": "block", "block_structure": [128, 128]},
                    "input_activations": {**FP8, "strategy": "group", "dynamic": True, "group_size": 128}},
    "tensor-static": {"weights": {**FP8, "strategy": "tensor"},
                      "input_activations": {**FP8, "strategy": "tensor", "dynamic": False}},
    "channel-weight-only": {"weights": {**FP8, "strategy": "channel"}},
}  # fmt: skip


def method_of(group: dict, **top: object) -> CompressedTensorsMethod:
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], **group}}, **top}  # fmt: skip
    return CompressedTensorsMethod(config)


KIT_CASES = [(n, c) for n, g in KIT_CONFIGS.items() for c in quantization_cases(method_of(g), (torch.float32,))]


@pytest.mark.parametrize(("scheme", "case"), KIT_CASES, ids=[f"{n}-{c}" for n, c in KIT_CASES])
def test_conformance(scheme: str, case) -> None:
    check_quantization_case(method_of(KIT_CONFIGS[scheme]), case)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "pack-quantized"}, "format: 'pack-quantized' is not supported"),
        ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ({"quantization_status": "frozen"}, "quantization_status: 'frozen'"),
        ({"config_groups": {}}, "config_groups: {}"),
        ({"config_groups": ["Linear"]}, "config_groups: \\['Linear'\\]"),
        ({"config_groups": {"g": {"targets": "Linear", "weights": {}}}}, "config_groups.g.targets"),
        ({"ignore": "lm_head"}, "ignore: 'lm_head'"),
    ],
)
def test_what_it_does_not_read_is_refused_naming_the_field(change, message) -> None:
    config = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], **SCHEMES["channel"]}}, **change}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        CompressedTensorsMethod(config)
    with pytest.raises(ValueError, match=r"weights: type 'int' with num_bits 4 is not supported"):
        method_of({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}})


def test_targets_and_ignore_choose_each_layers_group() -> None:
    from kvloom.interfaces import LayerInfo, LayerKind

    method = CompressedTensorsMethod({
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["re:.*mlp.gate$", "lm_head"],
        "config_groups": {"dense": {"targets": ["Linear"], **KIT_CONFIGS["tensor-static"]},
                          "attn": {"targets": ["re:.*self_attn.*"], **SCHEMES["channel"]}},
    })  # fmt: skip

    def scheme(*prefixes: str) -> object:
        layer = method.layer_method(LayerInfo(LayerKind.LINEAR, prefixes[0], prefixes, 64, (64,) * len(prefixes)))
        return None if layer is None else layer.scheme.weights

    attn = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
    assert scheme(*attn) == "channel"
    assert scheme("model.layers.0.mlp.down_proj") == "tensor"
    assert scheme("model.layers.0.mlp.gate") is None
    with pytest.raises(ValueError, match="different config groups"):
        scheme("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.up_proj")
