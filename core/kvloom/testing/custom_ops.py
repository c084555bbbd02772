"""The references of the custom ops a platform may provide (``kvloom.interfaces.
CUSTOM_OP_SIGNATURES``) and the check that holds a replacement to them.

``custom_op_reference(name)`` is the torch code an op replaces (what the layers compute
with ``--custom-ops none``); ``check_custom_op`` runs a replacement next to it and holds it
to the contract: bit-identical, within ``NORM_MAX_ULP`` for the 16-bit norms, within the
tolerances below of the float64 definitions (``lora_delta_reference``,
``fused_moe_reference``), or, for the random ``random_sample``, the same distribution by a
chi-square test.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvloom.layers.custom_op_reference import custom_op_reference


# ---------------------------------------------------------------------------- LoRA
def lora_delta_reference(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """What the ``lora_delta`` op (``kvloom.interfaces.CUSTOM_OP_SIGNATURES``) computes,
    token by token in float64: ``y[t] + B[s] @ (A[s] @ x[t])`` with ``s = token_slots[t]``
    (the op reads them from its ``LoRAMapping``),
    for ``x [N, in]``, ``y [N, out]``, ``lora_a [slots, R, in]``, ``lora_b [slots, out, R]``
    (slot 0, no adapter, holds zeros). Returns ``[N, out]`` float64."""
    a = lora_a.double()[token_slots.long()]  # [N, R, in]
    b = lora_b.double()[token_slots.long()]  # [N, out, R]
    shrunk = torch.bmm(a, x.double().unsqueeze(-1))  # [N, R, 1]
    return y.double() + torch.bmm(b, shrunk).squeeze(-1)


# ---------------------------------------------------------------------------- MoE
def fused_moe_reference(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """What the ``fused_moe`` op computes, in float64 without intermediate rounding:
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)`` with ``e = topk_ids[t, j]``
    and ``[g | u] = w13[e] @ hidden[t]``. Returns ``[T, H]`` float64 on ``hidden``'s device.
    Expert by expert (one expert's weights in float64 at a time), so model-sized layers fit."""
    inter = w2.shape[-1]
    x = hidden.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=hidden.device)
    ids = topk_ids.long()
    weights = topk_weights.double()
    for expert in torch.unique(ids).tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        gate_up = x[tokens] @ w13[expert].double().T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (act @ w2[expert].double().T) * weights[tokens, slots, None])
    return out


# ---------------------------------------------------------------------- custom ops

#: Relative tolerance (max |op - float64 definition| / max |float64 definition|) of the
#: ``lora_delta`` op, by dtype; the torch code stays well inside (fp32 ~4e-7, fp16 ~7e-4,
#: bf16 ~5e-3 on random adapters).
LORA_DELTA_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}

#: Relative tolerance (max |op - float64 definition| / max |float64 definition|) of the
#: ``fused_moe`` op, by dtype; the torch code rounds every GEMM output and the SiLU product
#: to the dtype (fp32 ~1e-6, fp16 ~1e-3, bf16 ~8e-3 on random experts).
FUSED_MOE_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

#: ``qk_norm_rotary``'s largest distance from its torch code, relative to the largest
#: value: the norm's two ulp (see ``NORM_MAX_ULP``) of both rotated halves plus the
#: rotation's own rounding.
QK_NORM_ROTARY_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 3e-3,
                                                       torch.bfloat16: 2.5e-2}  # fmt: skip

#: ``random_sample``: draws per sampled row (default of ``check_custom_op``'s ``draws``),
#: made in ``RANDOM_SAMPLE_CALLS`` calls of the op on the rows repeated
#: ``draws / RANDOM_SAMPLE_CALLS`` times each.
RANDOM_SAMPLE_DRAWS = 4000
RANDOM_SAMPLE_CALLS = 4
#: ``random_sample``: a sampled row fails when its chi-square statistic exceeds the
#: chi-square quantile at this normal quantile (one-sided ~1e-9: a correct op fails a
#: row about once in a billion; a wrong distribution at thousands of draws fails by far).
RANDOM_SAMPLE_Z = 6.0
#: ``random_sample``: tokens are pooled (least likely first) into bins of at least this
#: many expected draws, where the chi-square approximation holds.
RANDOM_SAMPLE_MIN_EXPECTED = 5.0

#: The largest distance of a 16-bit norm from the torch code, in units in the last place.
NORM_MAX_ULP = 2
#: The largest relative distance (max |diff| / max |torch|) of a float32 norm.
NORM_FP32_MAX_REL = 1e-5


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers ordered like their values (adjacent floats differ by 1)."""
    i = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()]) if t.is_floating_point() else t


def _assert_relative(
    report: dict[str, Any], name: str, got: torch.Tensor, reference: torch.Tensor,
    tolerances: dict[torch.dtype, float], what: str,
) -> None:  # fmt: skip
    """``max |got - reference| / max |reference|`` (into ``report["max_rel"]``) is within
    ``tolerances[got.dtype]`` (1e-5 for a dtype it does not name); ``what`` names the
    reference in the error."""
    rel = ((got.double() - reference.double()).abs().max() / reference.double().abs().max().clamp_min(1e-30)).item()
    report["max_rel"] = rel
    tolerance = tolerances.get(got.dtype, 1e-5)
    assert rel <= tolerance, f"{name}: {rel:.3g} (relative) from {what}; allowed {tolerance}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _chi_square_bound(dof: int, z: float) -> float:
    """The chi-square(dof) quantile at the standard normal quantile ``z``
    (Wilson-Hilferty; above the exact quantile for one degree of freedom)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) of a row's token ``counts`` against ``probs``
    (float64; tokens of probability 0, never drawn, add nothing), with tokens pooled least likely first
    into bins of at least ``RANDOM_SAMPLE_MIN_EXPECTED`` expected draws."""
    expected = probs * draws
    order = torch.argsort(expected)
    bins: list[tuple[float, float]] = []
    exp_sum = obs_sum = 0.0
    for exp, obs in zip(expected[order].tolist(), counts[order].tolist()):  # lists: fast at 150K tokens
        exp_sum += exp
        obs_sum += obs
        if exp_sum >= RANDOM_SAMPLE_MIN_EXPECTED:
            bins.append((obs_sum, exp_sum))
            exp_sum = obs_sum = 0.0
    if exp_sum > 0 or obs_sum > 0:  # a remainder under the minimum joins the last bin
        last_obs, last_exp = bins.pop() if bins else (0.0, 0.0)
        bins.append((last_obs + obs_sum, last_exp + exp_sum))
    statistic = sum((obs - exp) ** 2 / exp for obs, exp in bins)
    return statistic, len(bins) - 1


def _repeat_rows(t: torch.Tensor, times: int) -> torch.Tensor:
    """``t.repeat(times, 1)`` (row i of copy c at row c * rows + i), keeping ``t``'s row
    stride when its rows are strided: the padding between rows holds 1e4, a logit that
    would win wherever an op reads past a row's end."""
    rows, vocab = t.shape
    repeated = t.repeat(times, 1)
    if t.stride(1) != 1 or t.stride(0) <= vocab:
        return repeated
    padded = torch.full((rows * times, t.stride(0)), 1e4, dtype=t.dtype, device=t.device)
    padded[:, :vocab] = repeated
    return padded[:, :vocab]


def _check_random_sample(op: Any, args: tuple[Any, ...], out: torch.Tensor, expected: torch.Tensor,
                         draws: int) -> dict[str, Any]:  # fmt: skip
    """The distributional part of ``random_sample``'s contract (see ``check_custom_op``)."""
    logits, temperature, greedy = args
    rows, vocab = logits.shape
    assert out.device == logits.device, f"random_sample: out is on {out.device}, not the logits' ({logits.device})"
    greedy_rows = greedy.cpu() if greedy is not None else torch.zeros(rows, dtype=torch.bool)
    want = expected.cpu()

    def check_call(got: torch.Tensor, copies: int) -> torch.Tensor:
        got = got.cpu()
        assert bool(((got >= 0) & (got < vocab)).all()), (
            f"random_sample: token ids outside 0..{vocab - 1}: {got[(got < 0) | (got >= vocab)][:5].tolist()}"
        )
        mask = greedy_rows.repeat(copies)
        assert torch.equal(got[mask], want.repeat(copies)[mask]), (
            "random_sample: greedy rows differ from the torch code's argmax"
        )
        return got

    check_call(out, 1)
    sampled_rows = (~greedy_rows).nonzero().flatten().tolist()
    report: dict[str, Any] = {"draws": 0, "max_chi2_ratio": 0.0}
    if not sampled_rows:
        return report
    calls = RANDOM_SAMPLE_CALLS
    copies = max(1, -(-draws // calls))
    big_logits = _repeat_rows(logits, copies)
    big_temperature = temperature.repeat(copies)
    big_greedy = greedy.repeat(copies) if greedy is not None else None
    outputs = []
    for _ in range(calls):
        got = op(big_logits, big_temperature, big_greedy)
        assert isinstance(got, torch.Tensor) and got.shape == (rows * copies,) and got.dtype == torch.int64, (
            f"random_sample: out on {rows * copies} rows is {getattr(got, 'shape', got)}, expected "
            f"({rows * copies},) int64"
        )
        outputs.append(check_call(got, copies).view(copies, rows))
    samples = torch.cat(outputs)  # [calls * copies, rows]
    total = samples.shape[0]
    scaled = (logits.float() / temperature.unsqueeze(1)).cpu().double()  # the torch code's float32 division
    probs = torch.softmax(scaled, dim=1)
    # Two independent calls repeat all their draws of rows with sum(p**2) < 0.5 with
    # probability below 0.5**copies.
    if copies >= 40 and any(float((probs[row] ** 2).sum()) < 0.5 for row in sampled_rows):
        first, second = outputs[0][:, sampled_rows], outputs[1][:, sampled_rows]
        assert not torch.equal(first, second), "random_sample: two calls drew the same tokens: fresh noise per call"
    for row in sampled_rows:
        counts = torch.bincount(samples[:, row], minlength=vocab).double()
        impossible = (probs[row] == 0) & (counts > 0)
        assert not bool(impossible.any()), (
            f"random_sample: row {row} drew tokens of probability 0: {impossible.nonzero().flatten()[:5].tolist()}"
        )
        statistic, dof = _chi_square(counts, probs[row], total)
        if dof == 0:
            continue
        bound = _chi_square_bound(dof, RANDOM_SAMPLE_Z)
        report["max_chi2_ratio"] = max(report["max_chi2_ratio"], statistic / bound)
        assert statistic <= bound, (
            f"random_sample: row {row}'s token frequencies over {total} draws do not follow softmax(logits / "
            f"temperature): chi-square {statistic:.1f} > {bound:.1f} ({dof} degrees of freedom)"
        )
    report["draws"] = total
    return report


def check_custom_op(name: str, op: Any, *args: Any, draws: int = RANDOM_SAMPLE_DRAWS) -> dict[str, Any]:
    """Run the custom op ``op`` (your platform's kernel for ``name``) and its torch code
    (``custom_op_reference(name)``) on ``args`` and hold ``op`` to kvloom's contract;
    raise ``AssertionError`` saying what differs, else return a report (``passed``,
    ``exact``: the fraction of bit-identical elements, ``max_ulp`` for 16-bit norms,
    ``max_rel`` for float32 norms, ``lora_delta`` and ``fused_moe``). The contract, per op:

    - every op: new output tensors of the reference's shapes and dtypes, and every input
      left untouched (``lora_delta`` excepted: it may add the update to ``y`` in place);
    - ``silu_and_mul``, ``rotary_qk``, and the residual sum (second output) of
      ``fused_add_rms_norm``: bit-identical to the torch code;
    - ``rms_norm`` and the normalised output of ``fused_add_rms_norm``: at most
      ``NORM_MAX_ULP`` (2) ulp from the torch code in float16/bfloat16 (a kernel may sum
      the squares in another order: the fp32 variance then differs in its last bit, the
      normalised value by one ulp, the product with the weight by up to two; kvloom's CUDA
      kernels do), at most ``NORM_FP32_MAX_REL`` (1e-5) relative in float32;
    - ``qk_norm_rotary``: within ``QK_NORM_ROTARY_TOLERANCES[dtype]`` (relative to the
      largest value) of the torch code (a norm, as above, then ``rotary_qk``);
    - ``lora_delta``: within ``LORA_DELTA_TOLERANCES[dtype]`` (relative to the largest
      value) of the float64 definition ``lora_delta_reference``; rows of tokens without
      an adapter (slot 0) are ``y`` exactly;
    - ``fused_moe``: within ``FUSED_MOE_TOLERANCES[dtype]`` (relative to the largest value)
      of the float64 definition ``fused_moe_reference``;
    - ``random_sample`` (``logits, temperature, greedy``), a random draw: output ``[B]``
      int64 on the logits' device, token ids in ``0..V-1``, greedy rows equal to the
      torch code's ``argmax`` exactly; and ``draws`` (default ``RANDOM_SAMPLE_DRAWS``)
      draws per sampled row, from ``RANDOM_SAMPLE_CALLS`` calls on the rows repeated
      (strided rows stay strided), follow ``softmax(logits.float() / temperature)``: no
      token of probability 0, and each row's chi-square statistic (tokens pooled into bins
      of >= 5 expected draws) within its quantile at ``RANDOM_SAMPLE_Z`` (6) standard
      deviations; and two calls do not repeat all their draws. Use small vocabularies
      (8-64 tokens), NaN-free logits, temperatures other than 1 and spread logits (so that
      an op ignoring the temperature, or taking the argmax, fails); report ``draws`` and
      ``max_chi2_ratio`` (largest statistic / bound).

    Use random inputs of your model's shapes, on your device, for every dtype you enable
    the op for."""
    reference = custom_op_reference(name)

    def clone(values: tuple[Any, ...]) -> list[Any]:
        return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]

    before = clone(args)
    expected = reference(*clone(args))
    actual = op(*args)
    for i, (arg, original) in enumerate(zip(args, before)):
        if isinstance(arg, torch.Tensor) and not (name == "lora_delta" and i == 1):
            assert _same_bits(arg, original), f"{name} changed its argument {i}: inputs must be left untouched"
    labels = ("normed", "residual") if name == "fused_add_rms_norm" else ("out",)
    actual_t = actual if isinstance(actual, tuple) else (actual,)
    expected_t = expected if isinstance(expected, tuple) else (expected,)
    assert len(actual_t) == len(expected_t), f"{name}: returned {len(actual_t)} tensors, expected {len(expected_t)}"
    report: dict[str, Any] = {"name": name, "passed": False}
    for label, got, want in zip(labels, actual_t, expected_t):
        assert isinstance(got, torch.Tensor), f"{name}: {label} is {type(got).__name__}, not a tensor"
        assert got.shape == want.shape and got.dtype == want.dtype, (
            f"{name}: {label} is {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
        )
        got_c, want_c = got.detach().cpu(), want.detach().cpu()
        exact = (_bits(got_c) == _bits(want_c)).float().mean().item() if got_c.numel() else 1.0
        report["exact"] = min(report.get("exact", 1.0), exact)
        if name in ("rms_norm", "fused_add_rms_norm") and label != "residual":
            if got_c.dtype == torch.float32:
                rel = ((got_c - want_c).abs().max() / (want_c.abs().max().clamp_min(1e-30))).item()
                report["max_rel"] = rel
                assert rel <= NORM_FP32_MAX_REL, (
                    f"{name}: {label} is {rel:.3g} (relative) from the torch code; float32 allows {NORM_FP32_MAX_REL}"
                )
            else:
                ulp = int((_ordered_bits(got_c) - _ordered_bits(want_c)).abs().max().item())
                report["max_ulp"] = ulp
                assert ulp <= NORM_MAX_ULP, (
                    f"{name}: {label} is {ulp} ulp from the torch code; {got_c.dtype} allows at most {NORM_MAX_ULP}"
                )
        elif name == "qk_norm_rotary":
            _assert_relative(report, name, got_c, want_c, QK_NORM_ROTARY_TOLERANCES, "the torch code")
        elif name == "lora_delta":
            x, y, lora_a, lora_b, mapping = before
            definition = lora_delta_reference(x, y, lora_a, lora_b, mapping.token_slots.cpu()).cpu()
            _assert_relative(report, name, got_c, definition, LORA_DELTA_TOLERANCES, "the float64 definition")
            base_rows = mapping.token_slots.cpu() == 0
            assert _same_bits(got_c[: len(base_rows)][base_rows], y.cpu()[: len(base_rows)][base_rows]), (
                f"{name}: rows without an adapter must be y exactly"
            )
        elif name == "random_sample":
            # The original arguments (untouched, as checked above): clones of strided rows
            # would be contiguous.
            report.update(_check_random_sample(op, args, got, want, draws))
        elif name == "fused_moe":
            definition = fused_moe_reference(*[t.cpu() for t in before]).cpu()
            _assert_relative(report, name, got_c, definition, FUSED_MOE_TOLERANCES, "the float64 definition")
        else:
            assert exact == 1.0, (
                f"{name}: {label} differs from the torch code in {1 - exact:.2%} of its elements; it must be "
                "bit-identical"
            )
    report["passed"] = True
    return report
