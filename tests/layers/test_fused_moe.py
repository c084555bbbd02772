"""``kvloom.layers.fused_moe``: routing against HF transformers' routers (Mixtral,
Qwen3-MoE, DeepSeek-V2, DeepSeek-V3) on random inputs, the torch expert path against HF's
experts and the float64 definition, and the experts stacked from per-expert checkpoint
tensors by the generic loader."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvloom.layers.custom_ops import OP_SIGNATURES, set_custom_ops
from kvloom.layers.fused_moe import FusedMoE, fused_moe_torch, select_experts
from kvloom.models.weights import checkpoint_names, load_checkpoint_weights, weights_not_loaded
from kvloom.testing import check_custom_op, custom_op_reference, fused_moe_reference

HIDDEN = 32
TOKENS = 97


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (weights, ids) ordered by expert id: the choice as a set."""
    ids = ids.long()
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _randomize(router: nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    return torch.randn(TOKENS, HIDDEN, generator=gen)


def _assert_same_routing(hf_out: tuple, ours: tuple[torch.Tensor, torch.Tensor], ordered: bool) -> None:
    _, hf_weights, hf_ids = hf_out
    weights, ids = ours
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == hf_weights.shape == ids.shape
    if ordered:  # same slot order too (it decides the renormalisation's summation order)
        assert torch.equal(ids.long(), hf_ids.long())
        assert torch.equal(weights, hf_weights.float())
    hw, hi = _sorted_by_id(hf_weights.float(), hf_ids)
    w, i = _sorted_by_id(weights, ids)
    assert torch.equal(i, hi)
    assert torch.equal(w, hw), (w - hw).abs().max()


@pytest.mark.parametrize("top_k", [2, 3])
def test_mixtral_routing_matches_hf(top_k: int) -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    router = MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=top_k))
    x = _randomize(router, seed=1)
    with torch.no_grad():
        hf = router(x)
    _assert_same_routing(hf, select_experts(hf[0], top_k, renormalize=True), ordered=True)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_routing_matches_hf(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    x = _randomize(router, seed=2)
    with torch.no_grad():
        hf = router(x)
    _assert_same_routing(hf, select_experts(hf[0], 4, renormalize=norm_topk_prob), ordered=True)


@pytest.mark.parametrize(
    ("topk_method", "n_group", "topk_group"), [("greedy", None, None), ("group_limited_greedy", 4, 2)]
)
def test_deepseek_v2_routing_matches_hf(topk_method: str, n_group: int | None, topk_group: int | None) -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, topk_method=topk_method,
        n_group=n_group or 1, topk_group=topk_group or 1, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    x = _randomize(router, seed=3)
    with torch.no_grad():
        hf = router(x)
    ours = select_experts(
        hf[0], 3, renormalize=False, num_expert_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5
    )
    _assert_same_routing(hf, ours, ordered=False)
    if n_group is not None:  # the group limit really changes the choice for some tokens
        plain = select_experts(hf[0], 3, renormalize=False, routed_scaling_factor=2.5)
        assert not torch.equal(_sorted_by_id(*plain)[1], _sorted_by_id(*ours)[1])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_routing_matches_hf(norm_topk_prob: bool) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=3,
        routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    x = _randomize(router, seed=4)
    bias = 0.3 * torch.randn(32, generator=torch.Generator().manual_seed(5))
    router.e_score_correction_bias.copy_(bias)
    with torch.no_grad():
        hf = router(x)
    ours = select_experts(
        hf[0], 6, renormalize=norm_topk_prob, scoring_func="sigmoid", e_score_correction_bias=bias,
        num_expert_group=8, topk_group=3, routed_scaling_factor=2.5,
    )  # fmt: skip
    _assert_same_routing(hf, ours, ordered=False)
    # The bias steers the choice only: without it other experts win for some tokens.
    unbiased = select_experts(hf[0], 6, renormalize=norm_topk_prob, scoring_func="sigmoid", num_expert_group=8,
                              topk_group=3, routed_scaling_factor=2.5)  # fmt: skip
    assert not torch.equal(_sorted_by_id(*unbiased)[1], _sorted_by_id(*ours)[1])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": 9}, "top_k"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"num_expert_group": 3, "topk_group": 1}, "num_expert_group"),
        ({"num_expert_group": 4}, "num_expert_group"),
        ({"num_expert_group": 4, "topk_group": 5}, "topk_group"),
        ({"num_expert_group": 4, "topk_group": 1, "top_k": 3}, "top_k"),
        ({"e_score_correction_bias": torch.zeros(7)}, "e_score_correction_bias"),
    ],
)
def test_bad_routing_arguments_name_the_field(kwargs: dict, field: str) -> None:
    args = {"top_k": 2, "renormalize": True, **kwargs}
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        select_experts(torch.randn(4, 8), args.pop("top_k"), **args)
    with pytest.raises(ValueError, match=r"^router_logits\b"):
        select_experts(torch.randn(4, 8, 2), 2, renormalize=True)


# ---------------------------------------------------------------------- the experts


def _random_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    return w13, w2, gen


def _routed(tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return select_experts(torch.randn(tokens, num_experts, generator=gen) * 2, top_k, renormalize=True)


def test_torch_experts_match_hf_experts() -> None:
    """fused_moe_torch on HF Qwen3-MoE's own expert tensors and routing: HF's output."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True)  # fmt: skip
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config).eval()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        x = torch.randn(1, TOKENS, HIDDEN, generator=gen)
        expected = block(x)[0]
        weights, ids = select_experts(block.gate(x[0])[0], 2, renormalize=True)
        out = fused_moe_torch(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    assert torch.allclose(out, expected, rtol=0, atol=1e-6), (out - expected).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_torch_experts_pass_the_custom_op_contract(dtype: torch.dtype) -> None:
    """The torch code is within the op's tolerance of the float64 definition (what a
    platform's kernel is held to), including experts without tokens and T = 1."""
    w13, w2, gen = _random_experts(16, 64, 40, dtype, seed=7)
    for tokens in (1, 5, 64):
        x = torch.randn(tokens, 64, generator=gen).to(dtype)
        weights, ids = _routed(tokens, 16, 4, gen)
        report = check_custom_op("fused_moe", fused_moe_torch, x, w13, w2, weights, ids)
        assert report["passed"] and report["max_rel"] < 1e-2
    assert "fused_moe" in OP_SIGNATURES and custom_op_reference("fused_moe") is fused_moe_torch


def test_custom_op_check_catches_a_wrong_kernel() -> None:
    w13, w2, gen = _random_experts(8, 32, 16, torch.float32, seed=8)
    x = torch.randn(6, 32, generator=gen)
    weights, ids = _routed(6, 8, 2, gen)

    def unweighted(hidden, w13, w2, topk_weights, topk_ids):  # forgets the routing weights
        return fused_moe_torch(hidden, w13, w2, torch.ones_like(topk_weights), topk_ids)

    with pytest.raises(AssertionError, match="float64 definition"):
        check_custom_op("fused_moe", unweighted, x, w13, w2, weights, ids)
    definition = fused_moe_reference(x, w13, w2, weights, ids)
    assert definition.dtype == torch.float64 and definition.shape == x.shape


class _Block(nn.Module):
    """A model-like tree: ``layers.0.mlp.experts`` as in a Qwen3-MoE checkpoint."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = nn.Module()
        self.layers[0].mlp.experts = FusedMoE(4, 2, 8, 6, renormalize=True, prefix="layers.0.mlp.experts", **kwargs)


def _checkpoint(names: tuple[str, str, str], seed: int = 9) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate, up, down = names
    tensors = {}
    for e in range(4):
        tensors[f"layers.0.mlp.experts.{e}.{gate}.weight"] = torch.randn(6, 8, generator=gen)
        tensors[f"layers.0.mlp.experts.{e}.{up}.weight"] = torch.randn(6, 8, generator=gen)
        tensors[f"layers.0.mlp.experts.{e}.{down}.weight"] = torch.randn(8, 6, generator=gen)
    return tensors


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")], ids=["hf", "mixtral"])
def test_experts_are_stacked_from_per_expert_checkpoint_tensors(names: tuple[str, str, str]) -> None:
    model = _Block(expert_weight_names=names)
    ckpt = _checkpoint(names)
    assert set(checkpoint_names(model, ())) == set(ckpt)
    loaded = load_checkpoint_weights(model, ckpt.items(), ())
    assert weights_not_loaded(model, loaded) == ([], len(ckpt))
    experts = model.layers[0].mlp.experts
    gate, up, down = names
    for e in range(4):
        assert torch.equal(experts.w13_weight[e, :6], ckpt[f"layers.0.mlp.experts.{e}.{gate}.weight"])
        assert torch.equal(experts.w13_weight[e, 6:], ckpt[f"layers.0.mlp.experts.{e}.{up}.weight"])
        assert torch.equal(experts.w2_weight[e], ckpt[f"layers.0.mlp.experts.{e}.{down}.weight"])


def test_a_missing_or_misshapen_expert_tensor_is_an_error_naming_it() -> None:
    ckpt = _checkpoint(("gate_proj", "up_proj", "down_proj"))
    missing = "layers.0.mlp.experts.2.up_proj.weight"
    partial = {k: v for k, v in ckpt.items() if k != missing}
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load_checkpoint_weights(_Block(), partial.items(), ())
    model = _Block()
    names, _ = weights_not_loaded(model, set(partial))
    assert names == [missing]
    bad = dict(ckpt, **{missing: torch.zeros(8, 6)})
    with pytest.raises(ValueError, match=r"shard 2\.up has shape \(8, 6\), expected \(6, 8\)"):
        load_checkpoint_weights(model, bad.items(), ())


def test_correction_bias_is_a_loaded_parameter() -> None:
    model = _Block(use_correction_bias=True, scoring_func="sigmoid")
    ckpt = _checkpoint(("gate_proj", "up_proj", "down_proj"))
    ckpt["layers.0.mlp.experts.e_score_correction_bias"] = torch.randn(4)
    loaded = load_checkpoint_weights(model, ckpt.items(), ())
    experts = model.layers[0].mlp.experts
    assert experts.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(experts.e_score_correction_bias, ckpt["layers.0.mlp.experts.e_score_correction_bias"])
    assert weights_not_loaded(model, loaded)[0] == []


def test_layer_forward_routes_and_uses_the_active_op() -> None:
    torch.manual_seed(10)
    layer = FusedMoE(8, 2, 16, 12, renormalize=True, num_expert_group=4, topk_group=2, routed_scaling_factor=1.5)
    with torch.no_grad():
        layer.w13_weight.normal_()
        layer.w2_weight.normal_()
    x, logits = torch.randn(7, 16), torch.randn(7, 8)
    weights, ids = select_experts(logits, 2, renormalize=True, num_expert_group=4, topk_group=2,
                                  routed_scaling_factor=1.5)  # fmt: skip
    expected = fused_moe_torch(x, layer.w13_weight, layer.w2_weight, weights, ids)
    assert torch.equal(layer(x, logits), expected)
    calls = []

    def op(*args):
        calls.append(args)
        return fused_moe_torch(*args)

    set_custom_ops({"fused_moe": op})
    try:
        assert torch.equal(layer(x, logits), expected)
    finally:
        set_custom_ops({})
    assert len(calls) == 1 and torch.equal(calls[0][4], ids)


def test_bad_layer_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^top_k\b"):
        FusedMoE(4, 5, 8, 8, renormalize=True)
    with pytest.raises(ValueError, match=r"^intermediate_size\b"):
        FusedMoE(4, 2, 8, 0, renormalize=True)
    with pytest.raises(ValueError, match=r"^expert_weight_names\b"):
        FusedMoE(4, 2, 8, 8, renormalize=True, expert_weight_names=("w1", "w2"))


# ---------------------------------------------------------------------- tensor parallelism


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int, reduces: list[torch.Tensor]) -> None:
    """Build the next layers as tensor-parallel rank ``rank``; their all-reduces are recorded
    (and return their input: the ranks' partial outputs are summed by the test)."""
    from kvloom.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "tp_rank", lambda: rank)
    monkeypatch.setattr(parallel_state, "tp_world_size", lambda: world_size)
    monkeypatch.setattr(parallel_state, "all_reduce", lambda x: reduces.append(x) or x)


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")], ids=["hf", "mixtral"])
def test_parallel_experts_load_their_slices_and_sum_to_the_whole(
    names: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under TP=2 each rank keeps rows [r*I/2, (r+1)*I/2) of every expert's gate and up and
    the same columns of its down; the two ranks' outputs (one all-reduce each, after the
    combine) add up to the whole layer's."""
    ckpt = _checkpoint(names)
    whole = _Block(expert_weight_names=names)
    load_checkpoint_weights(whole, ckpt.items(), ())
    gen = torch.Generator().manual_seed(11)
    x, logits = torch.randn(13, 8, generator=gen), torch.randn(13, 4, generator=gen)
    expected = whole.layers[0].mlp.experts(x, logits)
    gate, up, down = names
    partial = []
    for rank in range(2):
        reduces: list[torch.Tensor] = []
        _as_rank(monkeypatch, rank, 2, reduces)
        model = _Block(expert_weight_names=names, parallel=True)
        load_checkpoint_weights(model, ckpt.items(), ())
        experts = model.layers[0].mlp.experts
        assert experts.intermediate_size == 3 and experts.full_intermediate_size == 6
        assert tuple(experts.w13_weight.shape) == (4, 6, 8) and tuple(experts.w2_weight.shape) == (4, 8, 3)
        rows = slice(3 * rank, 3 * rank + 3)
        for e in range(4):
            assert torch.equal(experts.w13_weight[e, :3], ckpt[f"layers.0.mlp.experts.{e}.{gate}.weight"][rows])
            assert torch.equal(experts.w13_weight[e, 3:], ckpt[f"layers.0.mlp.experts.{e}.{up}.weight"][rows])
            assert torch.equal(experts.w2_weight[e], ckpt[f"layers.0.mlp.experts.{e}.{down}.weight"][:, rows])
        partial.append(experts(x, logits))
        assert len(reduces) == 1  # one all-reduce for the layer, not one per expert
    torch.testing.assert_close(partial[0] + partial[1], expected, rtol=1e-5, atol=1e-5)


def test_parallel_experts_refuse_bad_shapes_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 1, 4, [])
    with pytest.raises(ValueError, match=r"experts intermediate_size: 6 is not divisible by the tensor-parallel size 4"):
        _Block(parallel=True)
    _as_rank(monkeypatch, 1, 2, [])
    ckpt = _checkpoint(("gate_proj", "up_proj", "down_proj"))
    bad = dict(ckpt, **{"layers.0.mlp.experts.1.down_proj.weight": torch.zeros(8, 3)})
    with pytest.raises(ValueError, match=r"shard 1\.down has shape \(8, 3\), expected \(8, 6\)"):
        load_checkpoint_weights(_Block(parallel=True), bad.items(), ())
