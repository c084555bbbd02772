"""Platform-supplied layer kernels (``kvloom.layers.custom_ops``): the loader activates
what the platform offers unless ``--custom-ops none``; layers call them; unknown names
are refused."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.model_fixtures import tiny_model_dir

from kvloom import LLM, SamplingParams
from kvloom.layers import custom_ops
from kvloom.layers.layernorm import RMSNorm


@pytest.fixture(autouse=True)
def _reset():
    yield
    custom_ops.set_custom_ops({})


def test_unknown_or_uncallable_ops_are_refused():
    with pytest.raises(ValueError, match="unknown custom op.*'layer_norm'.*known"):
        custom_ops.set_custom_ops({"layer_norm": lambda x: x})
    with pytest.raises(TypeError, match="'rms_norm' must be callable"):
        custom_ops.set_custom_ops({"rms_norm": 3})


def test_rms_norm_uses_the_active_op_for_both_forms():
    calls = []

    def rms_norm(x, weight, eps):
        calls.append("plain")
        return torch.zeros_like(x)

    def fused_add_rms_norm(x, residual, weight, eps):
        calls.append("add")
        return torch.zeros_like(x), x + residual

    norm = RMSNorm(8)
    x = torch.randn(2, 8)
    native = norm(x)
    custom_ops.set_custom_ops({"rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm})
    assert torch.equal(norm(x), torch.zeros_like(x))
    out, res = norm(x, x)
    assert calls == ["plain", "add"] and torch.equal(res, 2 * x)
    custom_ops.set_custom_ops({})
    assert torch.equal(norm(x), native)


def _platform_cls():
    from kvloom import plugins

    plugins.load_plugins()
    return plugins.get_platform_by_name("cpu")


@pytest.mark.parametrize("setting", ["all", "none"])
def test_loader_activates_the_platforms_ops_unless_none(monkeypatch, setting):
    from kvloom.layers.activation import SiluAndMul

    platform = _platform_cls()
    seen = []
    native = SiluAndMul.forward

    def silu_and_mul(x):
        seen.append(x.shape)
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    monkeypatch.setattr(platform, "custom_ops", classmethod(lambda cls, config: {"silu_and_mul": silu_and_mul}))
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the patched platform lives in this process
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB", custom_ops=setting)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert bool(seen) == (setting == "all")
    assert SiluAndMul.forward is native


def test_qwen3_attention_calls_qk_norm_rotary_once_a_layer(monkeypatch):
    """With the platform's ``qk_norm_rotary`` active, Qwen3's attention hands it the query
    and key heads of the fused projection (a strided view), both norm weights and eps; an
    op computing the torch code gives the torch path's tokens."""
    from kvloom.layers.rotary import qk_norm_rotary_torch

    platform = _platform_cls()
    calls = []

    def qk_norm_rotary(x, q_weight, k_weight, num_q_heads, eps, cos, sin):
        calls.append((tuple(x.shape), x.is_contiguous(), num_q_heads, eps))
        return qk_norm_rotary_torch(x, q_weight, k_weight, num_q_heads, eps, cos, sin)

    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the patched platform lives in this process
    prompt, params = {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=6)
    model = str(tiny_model_dir("qwen3"))
    native = LLM(model, dtype="float32", kv_cache_memory="32MiB", custom_ops="none").generate(prompt, params,
                                                                                           use_tqdm=False)  # fmt: skip
    monkeypatch.setattr(platform, "custom_ops", classmethod(lambda cls, config: {"qk_norm_rotary": qk_norm_rotary}))
    llm = LLM(model, dtype="float32", kv_cache_memory="32MiB", custom_ops="all")
    out = llm.generate(prompt, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == native[0].outputs[0].token_ids
    hf = llm.config.model.hf_config
    layers = hf.num_hidden_layers
    assert len(calls) >= layers and len(calls) % layers == 0
    shape, contiguous, num_q_heads, eps = calls[0]
    assert shape[1:] == (hf.num_attention_heads + hf.num_key_value_heads, hf.head_dim) and not contiguous
    assert (num_q_heads, eps) == (hf.num_attention_heads, hf.rms_norm_eps)
