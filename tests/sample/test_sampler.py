"""Sampler tests: masks against float64 references, reproducible seeds, penalties,
min_tokens, logprobs and a statistical check of the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kvloom.sample import Sampler, SamplingMetadata, compute_prompt_logprobs, make_generator
from kvloom.sample.sampler import TOP_P_CANDIDATES, apply_penalties, apply_top_k, apply_top_p, sampling_probs
from kvloom.sampling_params import SamplingParams

V = 32


def build(params, prompts=None, outputs=None, generators=None, vocab=V, eos=None):
    b = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[1, 2, 3]] * b,
        outputs if outputs is not None else [[]] * b,
        generators or {},
        vocab,
        "cpu",
        eos if eos is not None else [None] * b,
    )


# --------------------------------------------------------------- float64 references


def ref_allowed(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Reference distribution after temperature -> top-k -> top-p -> min-p, in float64,
    written with plain Python loops (renormalising after each step)."""
    scaled = [x / temperature for x in logits]
    keep = [True] * len(scaled)
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        keep = [x >= kth for x in scaled]

    def probs_of(keep_mask):
        m = max(x for x, k in zip(scaled, keep_mask) if k)
        e = [math.exp(x - m) if k else 0.0 for x, k in zip(scaled, keep_mask)]
        s = sum(e)
        return [v / s for v in e]

    if top_p < 1.0:
        p = probs_of(keep)
        order = sorted(range(len(p)), key=lambda i: -p[i])
        cum, new_keep = 0.0, [False] * len(p)
        for i in order:
            if not keep[i]:
                continue
            if cum >= top_p:
                break
            new_keep[i] = True
            cum += p[i]
        keep = new_keep
    if min_p > 0.0:
        p = probs_of(keep)
        pmax = max(p)
        keep = [k and pi >= min_p * pmax for k, pi in zip(keep, p)]
    return probs_of(keep)


def ref_penalties(logits, prompt, output, rep, freq, pres):
    out = list(logits)
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        c = output.count(t)
        out[t] -= freq * c + pres
    return out


def spread_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float32) * 2.0


# --------------------------------------------------------------- metadata


def test_metadata_fast_path_skips_unused_tensors():
    meta = build([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)])
    assert meta.output_token_counts is None and meta.no_penalties
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.min_tokens_mask is None and meta.max_num_logprobs is None
    assert not meta.all_greedy and not meta.all_random
    assert meta.greedy_mask.tolist() == [True, False]
    assert meta.temperature.tolist() == pytest.approx([1.0, 0.7])

    greedy = build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 2)
    assert greedy.all_greedy and greedy.greedy_mask is None and greedy.top_k is None and greedy.top_p is None


def test_metadata_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [[1]], [[], []], {}, V, "cpu", [None])
    with pytest.raises(ValueError, match="generators"):
        SamplingMetadata.build([SamplingParams()], [[1]], [[]], {3: torch.Generator()}, V, "cpu", [None])


# --------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_mixed_batch_keeps_greedy_rows():
    logits = spread_logits(6)
    sampler = Sampler()
    out = sampler(logits, build([SamplingParams(temperature=0.0)] * 6))
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=1).tolist()
    assert out.logprobs_tensors is None and out.logprobs_lists() is None

    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 5.0) for i in range(6)]
    torch.manual_seed(0)
    mixed = sampler(logits, build(params)).sampled_token_ids.tolist()
    for i in range(0, 6, 2):
        assert mixed[i] == int(logits[i].argmax())


def test_sampler_does_not_modify_input_logits():
    logits = spread_logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                             presence_penalty=0.5, min_tokens=2, stop_token_ids=[1])] * 3
    Sampler()(logits, build(params, outputs=[[1, 2], [3], []]))
    assert torch.equal(logits, before)


# --------------------------------------------------------------- truncation masks


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(5, 1.0, 0.0), (1, 1.0, 0.0), (0, 0.6, 0.0), (0, 0.05, 0.0), (0, 1.0, 0.2), (8, 0.7, 0.0), (10, 0.9, 0.3), (V, 0.999, 0.0)],
)
def test_truncation_masks_exactly_the_reference_tokens(top_k, top_p, min_p):
    logits = spread_logits(4, seed=3)
    temperature = 0.7
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    # row 3 is greedy: its truncation must be off so it cannot disturb the batch
    meta = build([params] * 3 + [SamplingParams(temperature=0.0)])
    probs = sampling_probs(logits, meta)
    for row in range(3):
        ref = ref_allowed(logits[row].double().tolist(), temperature, top_k, top_p, min_p)
        expected = [r > 0 for r in ref]
        assert (probs[row] > 0).tolist() == expected
        assert sum(expected) >= 1
        kept = probs[row] / probs[row].sum()
        assert kept.double().tolist() == pytest.approx(ref, abs=1e-6)


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    masked = apply_top_k(logits, torch.tensor([2]), 2)
    assert torch.isfinite(masked).tolist() == [[True, False, True, True, False]]


def test_top_p_per_row_values_and_disabled_rows():
    # row 0: probs 0.5,0.3,0.2 -> top_p 0.6 keeps two; row 1: top_p 1.0 keeps all.
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]], dtype=torch.float32)
    logits = probs.log()
    masked = apply_top_p(logits, torch.tensor([0.6, 1.0]))
    assert torch.isfinite(masked).tolist() == [[True, True, False], [True, True, True]]
    # the first token alone reaches p=0.45; p=0.85 needs all three
    masked = apply_top_p(logits, torch.tensor([0.45, 0.85]))
    assert torch.isfinite(masked).tolist() == [[True, False, False], [True, True, True]]


def test_top_p_on_flat_rows_beyond_the_candidates():
    # Row 0 is so flat that the nucleus needs more than TOP_P_CANDIDATES tokens (the
    # full-sort fallback); row 1 is peaked (candidates suffice); row 2 mixes top-k in.
    vocab = 4 * TOP_P_CANDIDATES
    g = torch.Generator().manual_seed(8)
    logits = torch.stack([torch.rand(vocab, generator=g) * 0.1, torch.randn(vocab, generator=g) * 4.0,
                          torch.randn(vocab, generator=g)])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9), SamplingParams(top_p=0.7, top_k=600)]
    probs = sampling_probs(logits, build(params, prompts=[[0]] * 3, vocab=vocab))
    kept = (probs > 0).sum(dim=1).tolist()
    assert kept[0] > TOP_P_CANDIDATES and kept[1] < TOP_P_CANDIDATES and kept[2] > TOP_P_CANDIDATES
    for row, p in enumerate(params):
        ref = ref_allowed(logits[row].double().tolist(), 1.0, p.top_k, p.top_p, 0.0)
        assert (probs[row] > 0).tolist() == [r > 0 for r in ref]


# --------------------------------------------------------------- statistics


def _empirical(samples: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(samples, minlength=vocab).double() / samples.numel()


def _assert_matches(freq: torch.Tensor, probs: list[float], n: int):
    for i, p in enumerate(probs):
        if p == 0.0:
            assert freq[i] == 0.0, f"token {i} has probability 0 but was sampled"
        else:
            sigma = math.sqrt(p * (1 - p) / n)
            assert abs(freq[i].item() - p) < 5 * sigma + 1e-9, (i, freq[i].item(), p)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_softmax(temperature):
    torch.manual_seed(1234)
    n = 40_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    logits = base.repeat(n, 1)
    meta = build([SamplingParams(temperature=temperature)] * n, prompts=[[0]] * n, vocab=8)
    samples = Sampler()(logits, meta).sampled_token_ids
    ref = torch.softmax(base.double() / temperature, dim=0).tolist()
    _assert_matches(_empirical(samples, 8), ref, n)


def test_combined_truncation_distribution_matches_reference():
    torch.manual_seed(99)
    n = 40_000
    base = spread_logits(1, vocab=16, seed=7)[0]
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.85, min_p=0.05)
    meta = build([params] * n, prompts=[[0]] * n, vocab=16)
    samples = Sampler()(base.repeat(n, 1), meta).sampled_token_ids
    ref = ref_allowed(base.double().tolist(), 0.9, 10, 0.85, 0.05)
    assert sum(r > 0 for r in ref) < 10  # the masks actually bite
    _assert_matches(_empirical(samples, 16), ref, n)


# --------------------------------------------------------------- seeds


def test_seeded_rows_reproducible_across_batch_compositions():
    vocab = 1000
    base = torch.zeros(vocab)  # flat: any noise difference changes the token
    seeded = SamplingParams(temperature=1.0, seed=7)
    steps = 6

    def run(batch_params, row_of_interest, seeds_by_row):
        gens = {r: make_generator(s, "cpu") for r, s in seeds_by_row.items()}
        got = []
        for _ in range(steps):
            meta = build(batch_params, prompts=[[0]] * len(batch_params), generators=gens, vocab=vocab)
            logits = base.repeat(len(batch_params), 1)
            got.append(int(Sampler()(logits, meta).sampled_token_ids[row_of_interest]))
        return got

    alone = run([seeded], 0, {0: 7})
    torch.manual_seed(1)
    in_batch = run([SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.5), seeded], 2, {0: 3, 2: 7})
    torch.manual_seed(2)
    mixed = run([SamplingParams(temperature=0.0), seeded, SamplingParams(top_k=3)], 1, {1: 7})
    assert alone == in_batch == mixed
    other_seed = run([SamplingParams(temperature=1.0, seed=8)], 0, {0: 8})
    assert other_seed != alone


def test_unseeded_rows_vary():
    torch.manual_seed(0)
    meta = build([SamplingParams(temperature=1.0)] * 2, vocab=1000)
    tokens = Sampler()(torch.zeros(2, 1000), meta).sampled_token_ids.tolist()
    assert tokens[0] != tokens[1]


# --------------------------------------------------------------- penalties and min_tokens


def test_penalties_match_reference():
    logits = spread_logits(4, seed=11)
    prompts = [[1, 2, 3, 3], [4, 5], [6], [7, 8, 9]]
    outputs = [[3, 3, 10, 11, 11, 11], [], [6, 6, 12], [0, 31, 31]]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.7),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, frequency_penalty=-0.5, presence_penalty=1.2),
        SamplingParams(temperature=0.0),
    ]
    meta = build(params, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, meta)
    for row, p in enumerate(params):
        ref = ref_penalties(logits[row].double().tolist(), prompts[row], outputs[row],
                            p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        assert got[row].tolist() == pytest.approx(ref, rel=1e-6, abs=1e-6)
    # and greedy follows the penalised logits
    sampled = Sampler()(logits, meta).sampled_token_ids
    assert sampled.tolist() == got.argmax(dim=1).tolist()


def test_frequency_penalty_changes_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    meta = build([SamplingParams(temperature=0.0, frequency_penalty=0.6)], outputs=[[0, 0]], vocab=4)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab = 8
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0, 0.0, 0.0, 0.0, 0.0]] * 4)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, stop_token_ids=[2]),
    ]
    outputs = [[5, 5], [5, 5, 5], [5], []]
    meta = build(params, outputs=outputs, vocab=vocab, eos=[1, 1, 1, 1])
    # row 0: 2 outputs < 3 -> EOS 1 and stop 2 banned -> 3; row 1 reached -> EOS 1;
    # row 2: ignore_eos so EOS not banned -> 1; row 3: no min_tokens -> 1
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [3, 1, 1, 1]
    # sampled rows respect it too
    torch.manual_seed(0)
    meta = build([SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[2])] * 200,
                 outputs=[[]] * 200, prompts=[[0]] * 200, vocab=vocab, eos=[1] * 200)
    sampled = Sampler()(torch.tensor([[0.0, 9.0, 8.0, 7.0, 0.0, 0.0, 0.0, 0.0]] * 200), meta).sampled_token_ids
    assert not ({1, 2} & set(sampled.tolist()))


# --------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_ranked():
    logits = spread_logits(3, seed=21)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),  # penalties must not affect logprobs
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    torch.manual_seed(0)
    out = Sampler()(logits, build(params, outputs=[[int(logits[0].argmax())], [], []]))
    lists = out.logprobs_lists()
    assert lists[2] is None and len(lists[0]) == 1 and len(lists[1]) == 1
    ref = torch.log_softmax(logits.double(), dim=1)
    for row, n in ((0, 3), (1, 0)):
        tl = lists[row][0]
        token = int(out.sampled_token_ids[row])
        assert tl.token_ids[0] == token and len(tl.token_ids) == n + 1
        assert tl.logprobs[0] == pytest.approx(ref[row, token].item(), abs=1e-5)
        assert tl.ranks[0] == int((ref[row] >= ref[row, token]).sum())
        order = ref[row].argsort(descending=True).tolist()
        assert tl.token_ids[1:] == order[:n]
        assert tl.logprobs[1:] == pytest.approx(ref[row, order[:n]].tolist(), abs=1e-5)
        assert tl.ranks[1:] == list(range(1, n + 1))
    # the penalised greedy token differs from the raw argmax and its rank says so
    assert lists[0][0].token_ids[0] != int(logits[0].argmax())
    assert lists[0][0].ranks[0] > 1


def test_compute_prompt_logprobs():
    logits = spread_logits(5, seed=4)
    nxt = torch.tensor([3, 1, 4, 1, 5])
    got = compute_prompt_logprobs(logits, nxt, 2)
    ref = torch.log_softmax(logits.double(), dim=1)
    assert len(got) == 5
    for p, tl in enumerate(got):
        t = int(nxt[p])
        assert tl.token_ids[0] == t
        assert tl.logprobs[0] == pytest.approx(ref[p, t].item(), abs=1e-5)
        assert tl.ranks[0] == int((ref[p] >= ref[p, t]).sum())
        assert tl.token_ids[1:] == ref[p].argsort(descending=True)[:2].tolist()
    assert compute_prompt_logprobs(logits[:0], nxt[:0], 2) == []


# --------------------------------------------------------------- logit_bias


def test_logit_bias_is_added_before_sampling_and_not_to_logprobs():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, logit_bias={1: 2.0}, logprobs=1),  # 4 + 2 > 5
        SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: -100.0, 3: 0.5}),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, build(params, vocab=4))
    assert out.sampled_token_ids.tolist() == [1, 3, 0]
    # Logprobs are the model's raw ones (vLLM's default), bias not included.
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs_tensors.logprobs[0, 0].item() == pytest.approx(raw[1].item())
    # A penalty applies after the bias.
    meta = build([SamplingParams(temperature=0.0, logit_bias={1: 2.0}, frequency_penalty=2.0)], outputs=[[1]],
                 vocab=4)  # fmt: skip
    assert Sampler()(logits[:1], meta).sampled_token_ids.tolist() == [0]


# --------------------------------------------------------------- the Python API's ranges


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"top_k": 1180591620717411303424}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 129}, "n"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**31}, "min_tokens"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": "x" * 1025}, "stop"),
        ({"stop": ["ok", "\ud800"]}, "a stop string is not valid Unicode"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"logit_bias": {5: 100.5}}, "the bias of token 5 is 100.5"),
        ({"logit_bias": {-1: 1.0}}, "key -1 is not a token id"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_sampling_params_refuse_out_of_range_values(kwargs, fragment):
    with pytest.raises(ValueError, match=None) as info:
        SamplingParams(**kwargs)
    assert fragment in str(info.value)


def test_check_sampling_state_refuses_what_a_batch_would_fail_on():
    """The engine core's dry run of one request's sampling state (after the model-bounded
    rules of kvloom.model_limits, tested in tests/test_model_limits.py)."""
    from kvloom.sample.metadata import check_sampling_state

    check_sampling_state(SamplingParams(top_k=32, logprobs=5, seed=-3, logit_bias={31: 1.0}), [1, 2], 32, 0)
    unbuildable = SamplingParams.model_construct(**{**SamplingParams().model_dump(), "top_p": "high"})
    with pytest.raises(ValueError, match="sampling_params: cannot be sampled with \\(TypeError"):
        check_sampling_state(unbuildable, [1], 32, None)
