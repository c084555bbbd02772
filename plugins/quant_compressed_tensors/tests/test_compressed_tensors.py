"""compressed-tensors checkpoints written by the ``compressed-tensors`` library itself (the
compressor llm-compressor saves with), fp8 (``float-quantized``) and int4 W4A16
(``pack-quantized``, group 32, asymmetric), load and give, in float32, the greedy tokens of
HF transformers on the same file (transformers + compressed-tensors decompress it on the
CPU) with fp8 activation quantization added as the scheme says (each token the reference's
choice or within 0.1 of its logit: ``assert_greedy_matches_reference``), and for int4 the
tokens of HF on the weights the compressed-tensors library decompresses itself (within
1e-3: weight-only); the method's layers pass the conformance kit; what it does not read is
refused naming the field.

HF 5 keeps an MoE's experts as one 3D parameter, not ``Linear`` modules, so the tool
leaves Qwen3-MoE's experts float: that checkpoint's ``ignore`` gains them (the router is
ignored as llm-compressor's recipes do); the kit covers quantized experts.
"""

from __future__ import annotations

import functools
import json
import shutil
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
    # llm-compressor's W4A16 (asymmetric, as its W4A16_ASYM preset), group 32 (the tiny dims divide it).
    "int4": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False,
                         "actorder": "weight"}},
}  # fmt: skip
FORMAT = {"channel": "float-quantized", "block": "float-quantized", "int4": "pack-quantized"}


def write_with_compressed_tensors(src: Path, dst: Path, scheme: dict, fmt: str) -> Path:
    """Quantize the tiny HF checkpoint ``src`` with the compressed-tensors library (weight
    scales and zero points from its own ``calculate_qparams``) and save it compressed in
    format ``fmt``, as llm-compressor does."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                ignore=["lm_head", "re:.*mlp.gate$"], format=fmt)  # fmt: skip
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
        elif args.strategy == "group":
            groups = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        else:
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        scale, zero_point = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())
    if "moe" in src.name:
        config_file = dst / "config.json"
        data = json.loads(config_file.read_text())
        # HF 5's module is the stacked ``mlp.experts`` itself; kvloom asks about ``mlp.experts.0.gate_proj``.
        data["quantization_config"]["ignore"].append("re:.*mlp\\.experts($|\\..*)")
        config_file.write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("compressed-tensors")
    return {(arch, name): write_with_compressed_tensors(tiny_model_dir(arch), root / f"{arch}-{name}", scheme,
                                                        FORMAT[name])
            for arch in ARCHS for name, scheme in SCHEMES.items()}  # fmt: skip


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_on_the_same_file(checkpoints, arch: str, scheme: str) -> None:
    from transformers import CompressedTensorsConfig

    model_dir = checkpoints[(arch, scheme)]
    assert json.loads((model_dir / "config.json").read_text())["quantization_config"]["format"] == FORMAT[scheme]
    prompts = random_prompts(500, lengths=(6, 27))
    generated = kvloom_greedy(model_dir, prompts, NEW_TOKENS)
    sequences = [p + g for p, g in zip(prompts, generated)]
    if scheme == "int4":  # weight-only: the activations as they are
        reference = decompressed_copy(model_dir, model_dir.with_name(model_dir.name + "-decompressed"), scheme)
        assert_greedy_matches_reference(prompts, generated, hf_logits_quantized(reference, sequences, lambda x: x),
                                        margin=1e-3)  # fmt: skip
        return
    quantize = functools.partial(reference_fp8, group=16 if scheme == "block" else None)
    logits = hf_logits_quantized(model_dir, sequences, quantize,
                                 quantization_config=CompressedTensorsConfig(run_compressed=False))  # fmt: skip
    assert_greedy_matches_reference(prompts, generated, logits)


def decompressed_copy(src: Path, dst: Path, scheme: str) -> Path:
    """A float checkpoint of ``src`` with every pack-quantized module decompressed by the
    compressed-tensors library's own compressor (transformers 5.24 cannot load a
    pack-quantized checkpoint whose stacked MoE experts stayed float)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file, save_file

    if dst.exists():
        return dst
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    quant = QuantizationScheme(targets=["Linear"], **SCHEMES[scheme])
    out = {n: t for n, t in tensors.items() if ".weight_" not in n}
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        prefix = name.removesuffix("weight_packed")
        state = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix + "weight_")}
        out[prefix + "weight"] = PackedQuantizationCompressor.decompress(state, quant)["weight"].float()
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


KIT_CONFIGS = {
    "channel-token": SCHEMES["channel"],
    "block-group": {"weights": {**FP8, "strategy": "block", "block_structure": [128, 128]},
                    "input_activations": {**FP8, "strategy": "group", "dynamic": True, "group_size": 128}},
    "tensor-static": {"weights": {**FP8, "strategy": "tensor"},
                      "input_activations": {**FP8, "strategy": "tensor", "dynamic": False}},
    "channel-weight-only": {"weights": {**FP8, "strategy": "channel"}},
    "int4-group-asym": SCHEMES["int4"],
    "int4-channel-sym": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": True}},
    # llm-compressor before compressed-tensors 0.20 stored act-order groups (weight_g_idx).
    "int4-actorder-group": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64,
                                        "symmetric": True, "actorder": "group"}},
}  # fmt: skip


def method_of(group: dict, **top: object) -> CompressedTensorsMethod:
    fmt = "pack-quantized" if group["weights"]["type"] == "int" else "float-quantized"
    config = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], **group}}, **top}  # fmt: skip
    return CompressedTensorsMethod(config)


KIT_CASES = [(n, c) for n, g in KIT_CONFIGS.items() for c in quantization_cases(method_of(g), (torch.float32,))]


@pytest.mark.parametrize(("scheme", "case"), KIT_CASES, ids=[f"{n}-{c}" for n, c in KIT_CASES])
def test_conformance(scheme: str, case) -> None:
    check_quantization_case(method_of(KIT_CONFIGS[scheme]), case)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "naive-quantized"}, "format: 'naive-quantized' is not supported"),
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
        method_of({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}},
                  format="float-quantized")  # fmt: skip


@pytest.mark.parametrize(
    ("weights", "activations", "message"),
    [
        ({"num_bits": 8, "type": "int", "strategy": "channel"}, None, "type 'int' with num_bits 8"),
        ({"num_bits": 4, "type": "int", "strategy": "tensor"}, None, "strategy 'tensor' with group_size None"),
        ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "dynamic"}, None,
         "actorder: 'dynamic'"),
        ({"num_bits": 4, "type": "int", "strategy": "channel"}, {**FP8, "strategy": "token", "dynamic": True},
         "input_activations: .* is not supported with 4-bit weights"),
    ],
)
def test_pack_quantized_it_does_not_read_is_refused_naming_the_field(weights, activations, message) -> None:
    with pytest.raises(ValueError, match=message):
        method_of({"weights": weights, "input_activations": activations})


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
