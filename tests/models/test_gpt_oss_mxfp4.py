"""gpt-oss with its experts in OpenAI's MXFP4 checkpoint format (issue 38): kvloom
dequantizes them at load (``kvloom.models.gpt_oss``: the experts are not quantizable) and
gives HF transformers' greedy tokens, in float32, on the weights transformers' own MXFP4
reader (``convert_moe_packed_tensors``) dequantizes.

The tiny random gpt-oss (``tiny_model_dir("gpt_oss")``) is written twice:

* MXFP4, as OpenAI's checkpoints store it: ``mlp.experts.gate_up_proj_blocks [E, 2I, H/32,
  16]`` / ``_scales [E, 2I, H/32]`` (HF's ``gate_up_proj [E, H, 2I]`` transposed, gate and up
  rows interleaved), ``down_proj_blocks [E, H, I/32, 16]`` / ``_scales``, biases and every
  other tensor as they were, and ``quantization_config = {"quant_method": "mxfp4", ...}``;
* the reference: the same checkpoint with the experts' plain tensors set to what
  transformers reads from those blocks, without a ``quantization_config``.

With ``kvloom-quant-mxfp4`` installed (as in CI) selection picks its ``mxfp4`` method for the
checkpoint, and the experts still load dequantized (no layer gets the method).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvloom import LLM, SamplingParams, plugins
from kvloom.interfaces import ModelRegistry
from kvloom.models.gpt_oss import GptOssExperts
from kvloom.testing import load_model, resolve_engine_config
from tests.helpers.model_fixtures import hf_greedy_tokens, random_prompts, tiny_model_dir

#: What a gpt-oss checkpoint's config.json says (only the experts are MXFP4).
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
#: The magnitudes of the FP4 E2M1 codes 0..7 (bit 3 is the sign).
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK = 32
NEW_TOKENS = 12
#: The fused expert tensors of HF's checkpoint, each stored ``[E, in, out]``.
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` (K a multiple of 32) -> OpenAI's ``blocks`` uint8 ``[..., K/32, 16]`` (value
    ``2b`` of a block in the low nibble of byte ``b``) and ``scales`` uint8 ``[..., K/32]``
    (E8M0: ``2 ** (s - 127)``): OCP's scale ``floor(log2(amax)) - 2``, values rounded to the
    nearest E2M1."""
    groups = weight.float().unflatten(-1, (-1, BLOCK))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.floor(torch.log2(amax)) - 2
    scaled = (groups / torch.exp2(exponent)).clamp(-6.0, 6.0)
    magnitude = (scaled.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs().argmin(-1)
    codes = magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def _copy_without_weights(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``original`` (the tiny float gpt-oss), ``mxfp4`` and ``reference`` (see the module docstring)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    original = tiny_model_dir("gpt_oss")
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    mxfp4, reference = _copy_without_weights(original, root / "mxfp4"), _copy_without_weights(original, root / "ref")
    quantized, dequantized = {}, {}
    for name, tensor in load_file(original / "model.safetensors").items():
        if not name.endswith(EXPERT_TENSORS):
            quantized[name] = dequantized[name] = tensor
            continue
        # OpenAI stores each expert's projection as [out, in] rows of 32-value blocks: HF's [E, in, out] transposed.
        blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # back to [E, in, out]
    save_file(quantized, mxfp4 / "model.safetensors")
    save_file(dequantized, reference / "model.safetensors")
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (mxfp4 / "config.json").write_text(json.dumps(config))
    return {"original": original, "mxfp4": mxfp4, "reference": reference}


def _expert_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return {n: t for n, t in load_file(model_dir / "model.safetensors").items() if n.endswith(EXPERT_TENSORS)}


def test_the_mxfp4_checkpoint_is_the_original_within_fp4_precision(checkpoints: dict[str, Path]) -> None:
    """transformers reads the written blocks back as the original weights (within E2M1's
    rounding, not exactly): the layout is the one gpt-oss's tools read."""
    original, reference = _expert_tensors(checkpoints["original"]), _expert_tensors(checkpoints["reference"])
    assert original.keys() == reference.keys() and len(original) == 4
    for name, weight in original.items():
        assert reference[name].shape == weight.shape
        error = ((reference[name] - weight).norm() / weight.norm()).item()
        assert 0 < error < 0.2, f"{name}: relative error {error:.3f}"


def _gate_then_up(interleaved: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` with gate and up interleaved along dim 1 -> kvloom's gate rows, then up rows."""
    return torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1)


def _mxfp4_installed() -> bool:
    return "mxfp4" in plugins.quantization_methods()


@pytest.mark.parametrize("quantization", [None, "mxfp4", "none"])
def test_the_experts_load_as_transformers_dequantizes_them(
    checkpoints: dict[str, Path], quantization: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever the selection (the checkpoint's ``mxfp4`` method, named or not, or
    ``--quantization none``), gpt-oss's experts get no quantization method and hold
    exactly transformers' dequantized weights, gate and up de-interleaved."""
    if quantization == "mxfp4" and not _mxfp4_installed():
        pytest.skip("kvloom-quant-mxfp4 is not installed")
    config = resolve_engine_config(model=str(checkpoints["mxfp4"]), dtype="float32", quantization=quantization)
    method = config.model.quantization
    expected_method = "mxfp4" if quantization != "none" and _mxfp4_installed() else None
    assert (method.NAME if method is not None else None) == expected_method
    with caplog.at_level(logging.INFO, logger="kvloom.models.gpt_oss"):
        model = load_model(ModelRegistry.load_model_cls(config.model.architecture), config)
    assert "MXFP4 experts are dequantized to torch.float32 at load" in caplog.text
    reference = load_file(checkpoints["reference"] / "model.safetensors")
    experts = {name: m for name, m in model.named_modules() if isinstance(m, GptOssExperts)}
    assert len(experts) == 2
    for name, layer in experts.items():
        assert layer.quant_method is None
        gate_up = reference[f"{name}.gate_up_proj"].transpose(1, 2)  # [E, 2I, H], gate and up rows interleaved
        assert torch.equal(layer.w13_weight, _gate_then_up(gate_up))
        assert torch.equal(layer.w13_bias, _gate_then_up(reference[f"{name}.gate_up_proj_bias"]))
        assert torch.equal(layer.w2_weight, reference[f"{name}.down_proj"].transpose(1, 2))
        assert torch.equal(layer.w2_bias, reference[f"{name}.down_proj_bias"])


def test_greedy_tokens_match_transformers_on_the_dequantized_weights(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the engine core in this process: quicker
    prompts = random_prompts(512, (7, 20, 33))
    expected = hf_greedy_tokens(checkpoints["reference"], prompts, NEW_TOKENS)
    llm = LLM(str(checkpoints["mxfp4"]), dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
              disable_log_stats=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
