"""kvloom.testing.custom_ops, the custom-op references: ``custom_op_reference(name)`` is the
torch code a platform's op replaces (what the layers run with ``--custom-ops none``), and
``check_custom_op`` holds a replacement to the contract: silu_and_mul, rotary_qk and the
residual sum of fused_add_rms_norm bit-identical; the norms within 2 ulp (16-bit) or 1e-5
relative (float32); lora_delta within the dtype's tolerance of the float64 definition,
rows without an adapter exact; fused_moe within the dtype's tolerance of its float64 definition; inputs untouched (lora_delta may update ``y`` in place);
random_sample, a random draw: greedy rows exact, the sampled rows' token frequencies those
of softmax(logits / temperature) (ops that ignore the temperature, take the argmax,
sample uniformly or reuse their noise fail)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.interfaces import CUSTOM_OP_SIGNATURES, LoRAMapping
from kvloom.interfaces.models import RMSNorm, RotaryEmbedding, SiluAndMul
from kvloom.testing import check_custom_op, custom_op_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _args(name: str, dtype: torch.dtype, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    if name == "rms_norm":
        return randn(7, 96), 1 + randn(96, scale=0.1), 1e-6
    if name == "fused_add_rms_norm":
        return randn(7, 96), randn(7, 96), 1 + randn(96, scale=0.1), 1e-6
    if name == "silu_and_mul":
        return (randn(7, 2 * 48),)
    if name == "rotary_qk":
        angles = torch.rand(7, 1, 16, generator=g) * 6
        return randn(7, 5, 32), angles.cos().to(dtype), angles.sin().to(dtype)
    if name == "qk_norm_rotary":  # 3 query heads then 2 key heads, a view of a fused qkv output
        angles = torch.rand(7, 1, 16, generator=g) * 6
        qkv = randn(7, 6 * 32, scale=3.0)
        heads = qkv[:, : 5 * 32].view(7, 5, 32)
        return heads, 1 + randn(32, scale=0.1), 1 + randn(32, scale=0.1), 3, 1e-6, angles.cos().to(dtype), \
            angles.sin().to(dtype)
    if name == "random_sample":  # 3 sampled rows (two temperatures far from 1) and a greedy one
        logits = randn(4, 24, scale=2.0)
        logits[1, 5] = float("-inf")  # a masked token: probability 0
        temperature = torch.tensor([0.6, 1.0, 1.7, 1.0])
        return logits, temperature, torch.tensor([False, False, False, True])
    if name == "fused_moe":  # 9 tokens, 6 experts (some without tokens), top-2
        ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(9)]).to(torch.int32)
        weights = torch.rand(9, 2, generator=g)
        return randn(9, 32), randn(6, 2 * 24, 32, scale=0.2), randn(6, 32, 24, scale=0.2), weights, ids
    assert name == "lora_delta"
    slots = torch.tensor([0, 1, 2, 1, 0, 2, 2], dtype=torch.int32)
    a, b = randn(3, 8, 64, scale=0.3), randn(3, 80, 8, scale=0.3)
    a[0], b[0] = 0, 0
    groups = [(s, (slots == s).nonzero().flatten()) for s in (1, 2)]
    return randn(7, 64), randn(7, 80), a, b, LoRAMapping(token_slots=slots, groups=groups)


def test_there_is_a_reference_for_every_op() -> None:
    assert {name: callable(custom_op_reference(name)) for name in CUSTOM_OP_SIGNATURES} == dict.fromkeys(
        CUSTOM_OP_SIGNATURES, True
    )
    with pytest.raises(ValueError, match="unknown custom op 'gelu'"):
        custom_op_reference("gelu")


def test_the_references_are_what_the_layers_run() -> None:
    x, weight, eps = _args("rms_norm", torch.bfloat16)
    norm = RMSNorm(96, eps=eps).to(torch.bfloat16)
    norm.weight.data.copy_(weight)
    assert torch.equal(norm(x), custom_op_reference("rms_norm")(x, weight, eps))
    (gate_up,) = _args("silu_and_mul", torch.float16)
    assert torch.equal(SiluAndMul()(gate_up), custom_op_reference("silu_and_mul")(gate_up))
    heads, cos, sin = _args("rotary_qk", torch.bfloat16)
    assert torch.equal(RotaryEmbedding.rotate_heads(heads, cos, sin), custom_op_reference("rotary_qk")(heads, cos, sin))


def test_qk_norm_rotary_is_what_qwen3_attention_runs() -> None:
    """The layer's own path (q_norm, k_norm, cat, rotation) equals the op's torch code."""
    x, q_weight, k_weight, num_q, eps, cos, sin = _args("qk_norm_rotary", torch.bfloat16)
    q_norm, k_norm = RMSNorm(32, eps=eps).to(torch.bfloat16), RMSNorm(32, eps=eps).to(torch.bfloat16)
    q_norm.weight.data.copy_(q_weight)
    k_norm.weight.data.copy_(k_weight)
    layer_path = RotaryEmbedding.rotate_heads(torch.cat((q_norm(x[:, :num_q]), k_norm(x[:, num_q:])), dim=1), cos, sin)
    assert torch.equal(layer_path, custom_op_reference("qk_norm_rotary")(x, q_weight, k_weight, num_q, eps, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_qk_norm_rotary_with_a_norm_summed_in_another_order_passes(dtype: torch.dtype) -> None:
    from kvloom.layers.rotary import rotary_qk_torch

    def qk_norm_rotary(x, q_weight, k_weight, num_q, eps, cos, sin):  # type: ignore[no-untyped-def]
        def norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            h64 = h.double()
            return w * (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)).float().to(h.dtype)

        return rotary_qk_torch(torch.cat((norm(x[:, :num_q], q_weight), norm(x[:, num_q:], k_weight)), dim=1), cos, sin)

    report = check_custom_op("qk_norm_rotary", qk_norm_rotary, *_args("qk_norm_rotary", dtype))
    assert report["passed"] and report["max_rel"] <= 2.5e-2


def test_qk_norm_rotary_with_the_weights_swapped_fails() -> None:
    def swapped(x, q_weight, k_weight, num_q, eps, cos, sin):  # type: ignore[no-untyped-def]
        return custom_op_reference("qk_norm_rotary")(x, k_weight, q_weight, num_q, eps, cos, sin)

    with pytest.raises(AssertionError, match=r"qk_norm_rotary: .* \(relative\) from the torch code; allowed"):
        check_custom_op("qk_norm_rotary", swapped, *_args("qk_norm_rotary", torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CUSTOM_OP_SIGNATURES))
def test_the_torch_code_passes(name: str, dtype: torch.dtype) -> None:
    report = check_custom_op(name, custom_op_reference(name), *_args(name, dtype))
    assert report["passed"] and report["name"] == name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_norm_summed_in_another_order_passes(dtype: torch.dtype) -> None:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x64 = x.double()
        normed = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).float().to(x.dtype)
        return weight * normed

    report = check_custom_op("rms_norm", rms_norm, *_args("rms_norm", dtype))
    assert report["max_ulp"] <= 2


def _one_ulp_up(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    flat = out.view(-1)
    flat[3] = torch.nextafter(flat[3].float(), torch.tensor(float("inf"))).to(t.dtype)
    if torch.equal(out, t):  # the float32 step was too small for the 16-bit dtype
        bits = flat.view(torch.int16)
        bits[3] += 1 if bits[3] >= 0 else -1
    return out


def test_bit_identical_ops_may_not_differ_by_one_ulp() -> None:
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return _one_ulp_up(F.silu(x[..., :48]) * x[..., 48:])

    with pytest.raises(AssertionError, match="silu_and_mul: out differs from the torch code .* must be bit-identical"):
        check_custom_op("silu_and_mul", silu_and_mul, *_args("silu_and_mul", torch.bfloat16))


def test_a_norm_three_ulps_off_fails() -> None:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = custom_op_reference("rms_norm")(x, weight, eps)
        bits = out.view(torch.int16).clone()
        bits.view(-1)[5] += 3
        return bits.view(x.dtype)

    with pytest.raises(AssertionError, match="rms_norm: out is 3 ulp from the torch code; .* at most 2"):
        check_custom_op("rms_norm", rms_norm, *_args("rms_norm", torch.bfloat16))


def test_an_op_that_changes_its_input_fails() -> None:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = custom_op_reference("rms_norm")(x, weight, eps)
        x.zero_()
        return out

    with pytest.raises(AssertionError, match="rms_norm changed its argument 0"):
        check_custom_op("rms_norm", rms_norm, *_args("rms_norm", torch.float32))


def test_lora_delta_may_add_in_place_but_not_touch_rows_without_an_adapter() -> None:
    def in_place(x, y, a, b, mapping):  # type: ignore[no-untyped-def]
        for slot, index in mapping.groups:
            y.index_add_(0, index, (x[index] @ a[slot].T) @ b[slot].T)
        return y

    assert check_custom_op("lora_delta", in_place, *_args("lora_delta", torch.float32))["passed"]

    def touches_base_rows(x, y, a, b, mapping):  # type: ignore[no-untyped-def]
        out = in_place(x, y, a, b, mapping)
        out[0] = torch.nextafter(out[0], torch.tensor(float("inf")))  # token 0 has no adapter
        return out

    with pytest.raises(AssertionError, match="lora_delta: rows without an adapter must be y exactly"):
        check_custom_op("lora_delta", touches_base_rows, *_args("lora_delta", torch.float32))


def _sample_ignoring_temperature(logits, temperature, greedy):  # type: ignore[no-untyped-def]
    return custom_op_reference("random_sample")(logits, torch.ones_like(temperature), greedy)


def _plain_argmax(logits, temperature, greedy):  # type: ignore[no-untyped-def]
    return logits.float().argmax(dim=1)


def _uniform(logits, temperature, greedy):  # type: ignore[no-untyped-def]
    drawn = torch.randint(0, logits.shape[1], (logits.shape[0],))
    return drawn if greedy is None else torch.where(greedy, logits.float().argmax(dim=1), drawn)


def _same_noise_every_call(logits, temperature, greedy):  # type: ignore[no-untyped-def]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return custom_op_reference("random_sample")(logits, temperature, greedy)


def _one_noise_per_call(logits, temperature, greedy):  # type: ignore[no-untyped-def]
    """The same noise for every row of a call (rows not independent)."""
    noise = -torch.log(-torch.log(torch.rand(logits.shape[1]).clamp_min(1e-12)))
    return custom_op_reference("random_sample")(logits, temperature, greedy).where(
        greedy if greedy is not None else torch.zeros(len(logits), dtype=torch.bool),
        (logits.float() / temperature.unsqueeze(1) + noise).argmax(dim=1),
    )


def _greedy_rows_sampled(logits, temperature, greedy):  # type: ignore[no-untyped-def]
    return custom_op_reference("random_sample")(logits, temperature, None)


def _out_of_range(logits, temperature, greedy):  # type: ignore[no-untyped-def]
    out = custom_op_reference("random_sample")(logits, temperature, greedy)
    out[0] = logits.shape[1]
    return out


def _int32(logits, temperature, greedy):  # type: ignore[no-untyped-def]
    return custom_op_reference("random_sample")(logits, temperature, greedy).to(torch.int32)


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (_sample_ignoring_temperature, r"row \d's token frequencies over 4000 draws do not follow softmax"),
        (_plain_argmax, "two calls drew the same tokens|do not follow softmax"),
        (_uniform, "do not follow softmax|tokens of probability 0"),
        (_same_noise_every_call, "two calls drew the same tokens"),
        (_one_noise_per_call, "do not follow softmax"),
        (_greedy_rows_sampled, "greedy rows differ from the torch code's argmax"),
        (_out_of_range, r"token ids outside 0\.\.23"),
        (_int32, "out is .* torch.int32, expected .* torch.int64"),
    ],
    ids=lambda v: getattr(v, "__name__", "")[1:] if callable(v) else "",
)
def test_a_wrong_random_sample_fails(op, message: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(AssertionError, match=message):
        check_custom_op("random_sample", op, *_args("random_sample", torch.bfloat16))


def test_random_sample_check_keeps_strided_rows_and_all_random_batches() -> None:
    logits, temperature, _ = _args("random_sample", torch.float32)
    wide = torch.full((4, 40), float("nan"))
    wide[:, :24] = logits
    strided = wide[:, :24]
    seen: list[tuple[int, ...]] = []

    def op(logits, temperature, greedy):  # type: ignore[no-untyped-def]
        seen.append(logits.stride())
        assert greedy is None
        return custom_op_reference("random_sample")(logits, temperature, greedy)

    report = check_custom_op("random_sample", op, strided, temperature, None, draws=800)
    assert report["draws"] == 800 and 0 < report["max_chi2_ratio"] < 1
    assert set(seen) == {(40, 1)}  # the first call and every repeated batch


def test_random_sample_chi_square_bound_is_calibrated() -> None:
    """The torch code passes with a wide margin on every dtype (statistic well under the
    bound), so a correct op does not fail by chance."""
    torch.manual_seed(1)
    ratios = [check_custom_op("random_sample", custom_op_reference("random_sample"),
                              *_args("random_sample", dtype, seed=s))["max_chi2_ratio"]
              for dtype in DTYPES for s in range(3)]  # fmt: skip
    assert max(ratios) < 0.7, ratios
