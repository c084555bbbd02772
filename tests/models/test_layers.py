"""kvloom layers against HF transformers' modules (exact where the arithmetic is the same)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvloom.layers.activation import SiluAndMul, get_gated_activation
from kvloom.layers.layernorm import RMSNorm
from kvloom.layers.linear import Linear, MergedLinear, QKVLinear
from kvloom.layers.rotary import RotaryEmbedding, get_rope_parameters
from kvloom.layers.vocab_embedding import LMHead, VocabEmbedding
from tests.helpers.model_fixtures import make_hf_config

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn_mscale": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
        "mscale": 0.707, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


def _hf_cos_sin(config, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(config)
    cos, sin = rope(torch.zeros(1, dtype=dtype), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_equal_hf(case, dtype):
    config = make_hf_config("llama", head_dim=32, max_position_embeddings=256, rope_parameters=dict(ROPE_CASES[case]))
    params = get_rope_parameters(config)
    assert params["rope_type"] == ROPE_CASES[case]["rope_type"]
    max_len = 256  # dynamic: equal to HF while the context stays within max_position_embeddings
    torch.set_default_dtype(dtype)
    try:
        rope = RotaryEmbedding(32, max_len, params, config.max_position_embeddings)
    finally:
        torch.set_default_dtype(torch.float32)
    positions = torch.arange(max_len)
    hf_cos, hf_sin = _hf_cos_sin(config, positions, dtype)
    cos, sin = rope.cos_sin(positions)
    # HF's tables repeat the half-size table twice ([freqs, freqs]).
    assert torch.equal(torch.cat([cos[:, 0], cos[:, 0]], -1), hf_cos)
    assert torch.equal(torch.cat([sin[:, 0], sin[:, 0]], -1), hf_sin)


def test_rotary_application_equals_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = make_hf_config("llama", head_dim=16)
    rope = RotaryEmbedding(16, 64, get_rope_parameters(config), 256)
    positions = torch.tensor([0, 5, 63, 17, 2])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    rq, rk = rope(positions, q, k)
    hf_cos, hf_sin = _hf_cos_sin(config, positions, torch.float32)
    eq, ek = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), hf_cos, hf_sin, unsqueeze_dim=0)
    assert torch.equal(rq, eq.transpose(0, 1))
    assert torch.equal(rk, ek.transpose(0, 1))


def test_rope_parameters_from_pre_v5_config_fields():
    old = SimpleNamespace(
        rope_theta=500000.0,
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        max_position_embeddings=8192,
    )
    assert get_rope_parameters(old) == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "rope_theta": 500000.0, "original_max_position_embeddings": 8192,
    }
    plain = SimpleNamespace(rope_theta=1e6, rope_scaling=None, max_position_embeddings=32)
    assert get_rope_parameters(plain) == {"rope_type": "default", "rope_theta": 1e6}


def test_unsupported_rope_and_activation_are_clear_errors():
    with pytest.raises(NotImplementedError, match="rope_type 'longrope' is not supported.*llama3"):
        RotaryEmbedding(16, 8, {"rope_type": "longrope", "rope_theta": 1e4}, 8)
    with pytest.raises(NotImplementedError, match="partial_rotary_factor"):
        RotaryEmbedding(16, 8, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, 8)
    with pytest.raises(NotImplementedError, match="hidden_act 'relu2'"):
        get_gated_activation("relu2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_equals_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(48, eps=1e-5)
    ours = RMSNorm(48, eps=1e-5)
    weight = torch.randn(48)
    hf.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    hf.to(dtype)
    ours.to(dtype)
    x, residual = torch.randn(7, 48, dtype=dtype), torch.randn(7, 48, dtype=dtype)
    assert torch.equal(ours(x), hf(x))
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, hf(residual + x))


def test_silu_and_mul():
    x = torch.randn(5, 2 * 24, dtype=torch.float64)
    assert torch.equal(SiluAndMul()(x), torch.nn.functional.silu(x[:, :24]) * x[:, 24:])


def test_qkv_linear_loads_slices_and_splits_output():
    layer = QKVLinear(hidden_size=8, head_size=4, num_heads=4, num_kv_heads=2, bias=True, prefix="attn.qkv_proj")
    w = {s: torch.randn(n, 8) for s, n in zip("qkv", (16, 8, 8))}
    b = {s: torch.randn(n) for s, n in zip("qkv", (16, 8, 8))}
    for shard in "qkv":
        layer.weight_loader(layer.weight, w[shard], shard)
        layer.weight_loader(layer.bias, b[shard], shard)
    x = torch.randn(3, 8, dtype=torch.float32)
    q, k, v = layer.split(layer(x))
    for shard, part in zip("qkv", (q, k, v)):
        torch.testing.assert_close(part, x @ w[shard].T + b[shard])
    with pytest.raises(ValueError, match=r"qkv_proj: checkpoint tensor for shard k has shape \(9, 8\), expected \(8, 8\)"):
        layer.weight_loader(layer.weight, torch.randn(9, 8), "k")
    with pytest.raises(KeyError, match="unknown shard 'x'"):
        layer.weight_loader(layer.weight, torch.randn(8, 8), "x")


def test_merged_and_plain_linear():
    merged = MergedLinear(6, [10, 10], prefix="mlp.gate_up_proj")
    gate, up = torch.randn(10, 6), torch.randn(10, 6)
    merged.weight_loader(merged.weight, gate, "0")
    merged.weight_loader(merged.weight, up, "1")
    x = torch.randn(2, 6)
    torch.testing.assert_close(merged(x), torch.cat([x @ gate.T, x @ up.T], -1))
    with pytest.raises(ValueError, match="needs a shard name"):
        merged.weight_loader(merged.weight, gate)
    plain = Linear(6, 3, prefix="o_proj")
    w = torch.randn(3, 6)
    plain.weight_loader(plain.weight, w)
    torch.testing.assert_close(plain(x), x @ w.T)
    assert plain.bias is None


def test_tied_lm_head_shares_the_embedding_weight():
    embed = VocabEmbedding(11, 4)
    head = LMHead(11, 4)
    head.tie_to(embed)
    assert head.weight is embed.weight
    embed.weight.data.normal_()
    ids = torch.tensor([0, 3, 10])
    hidden = embed(ids).to(torch.bfloat16)
    head.to(torch.bfloat16)
    logits = head(hidden)
    # The model dtype, as HF's lm_head: the sampler upcasts where it needs float32.
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, 11)
    torch.testing.assert_close(logits, hidden @ head.weight.T)
