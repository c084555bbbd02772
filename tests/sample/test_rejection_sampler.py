"""The rejection sampler keeps the target distribution exactly (chi-square over many
samples with deliberately bad drafts, fixed seeds, threshold p > 1e-3), and greedy
verification gives the target's argmax chain token for token."""

from __future__ import annotations

import pytest
import torch

from kvloom.sample.rejection_sampler import RejectionSampler, verification_metadata
from kvloom.sampling_params import SamplingParams

#: The chi-square tests pass when the p-value at the seeds used is above this.
P_THRESHOLD = 1e-3


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``observed`` counts against ``expected_probs``
    (categories with expected count < 5 pooled into one)."""
    n = observed.sum().double()
    expected = expected_probs.double() * n
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small].double(), observed[small].double().sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((observed.double() - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def _run(logits_rows, draft_probs_rows, n, params, seed, num_drafts=2):
    """n requests, each verifying ``num_drafts`` drafts drawn from the bad q rows against the
    same target logits rows; returns the sampler's output and the drafts."""
    torch.manual_seed(seed)
    vocab = logits_rows.shape[1]
    q = draft_probs_rows[:num_drafts]
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True) for j in range(num_drafts)], dim=1)  # [n, m]
    logits = logits_rows[: num_drafts + 1].repeat(n, 1)
    metadata = verification_metadata([params] * n, [[1]] * n, [[]] * n, drafts.tolist(), vocab, "cpu", [None] * n)
    out = RejectionSampler()(logits, drafts.reshape(-1), torch.full((n,), num_drafts), metadata,
                             draft_probs=q.repeat(n, 1))  # fmt: skip
    return out, drafts


def _target_probs(logits_rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target samples each row from (temperature, top-k, top-p, min-p)."""
    rows = []
    for row in logits_rows:
        scaled = row / params.temperature
        if params.top_k > 0:
            kth = scaled.topk(params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, 0)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = probs * mask
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        rows.append(probs / probs.sum())
    return torch.stack(rows)


LOGITS = torch.tensor([
    [2.0, 1.0, 0.5, 0.0, -1.0, 0.3],
    [0.0, 1.5, -0.5, 1.0, 0.2, 0.7],
    [1.0, 1.0, 1.0, -2.0, 0.5, 0.0],
])  # fmt: skip
#: A bad draft distribution: mass where the target has little.
BAD_Q = torch.tensor([
    [0.02, 0.02, 0.06, 0.3, 0.5, 0.1],
    [0.6, 0.01, 0.3, 0.01, 0.02, 0.06],
    [0.1, 0.1, 0.1, 0.5, 0.1, 0.1],
])  # fmt: skip


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
    ],
    ids=["plain", "top_k", "top_p_min_p"],
)
def test_random_verification_keeps_the_target_distribution(params: SamplingParams) -> None:
    n = 30_000
    out, drafts = _run(LOGITS, BAD_Q, n, params, seed=7)
    target = _target_probs(LOGITS, params)
    tokens, emitted = out.token_ids, out.num_emitted
    # Position 1 always; position j + 1 where j tokens were emitted before it from accepted
    # drafts: each marginal (given what came before, independent here) is the target's.
    for pos in range(3):
        has = emitted > pos
        counts = torch.bincount(tokens[has, pos], minlength=6)
        assert chi_square_p(counts, target[pos]) > P_THRESHOLD, (pos, counts, target[pos])
    # The drafts were bad: plenty were rejected (the test exercises the residual).
    assert 0.1 < float((emitted == 1).float().mean()) < 0.9


def test_deterministic_bad_drafts_keep_the_target_distribution() -> None:
    """One-hot q (draft_probs None): a draft of the target's least likely token."""
    n, vocab = 30_000, 6
    torch.manual_seed(3)
    drafts = torch.full((n, 1), 4)
    logits = LOGITS[:2].repeat(n, 1)
    params = SamplingParams(temperature=1.0)
    metadata = verification_metadata([params] * n, [[1]] * n, [[]] * n, drafts.tolist(), vocab, "cpu", [None] * n)
    out = RejectionSampler()(logits, drafts.reshape(-1), torch.ones(n, dtype=torch.long), metadata)
    target = _target_probs(LOGITS[:2], params)
    assert chi_square_p(torch.bincount(out.token_ids[:, 0], minlength=vocab), target[0]) > P_THRESHOLD
    accepted = out.num_emitted == 2
    assert abs(float(accepted.float().mean()) - float(target[0, 4])) < 0.01
    assert chi_square_p(torch.bincount(out.token_ids[accepted, 1], minlength=vocab), target[1]) > P_THRESHOLD


def test_greedy_verification_is_the_argmax_chain() -> None:
    vocab = 6
    argmax = LOGITS.argmax(dim=1).tolist()  # [0, 1, 0]
    cases = {  # drafts -> expected emitted tokens
        (0, 1): [0, 1, argmax[2]],  # both accepted, then the bonus
        (0, 3): [0, 1],  # the second rejected: replaced by the argmax
        (5, 1): [0],  # the first rejected
    }
    params = SamplingParams(temperature=0.0)
    drafts = [list(d) for d in cases]
    n = len(drafts)
    logits = LOGITS.repeat(n, 1)
    metadata = verification_metadata([params] * n, [[1]] * n, [[]] * n, drafts, vocab, "cpu", [None] * n)
    out = RejectionSampler()(logits, torch.tensor(drafts).reshape(-1), torch.full((n,), 2), metadata)
    for i, expected in enumerate(cases.values()):
        assert out.token_ids[i, : int(out.num_emitted[i])].tolist() == expected
        assert (out.token_ids[i, int(out.num_emitted[i]) :] == -1).all()


def test_penalties_see_the_drafts_before_each_position() -> None:
    """Row j is processed with the first j drafts in the output: a presence penalty on the
    accepted draft changes the next position's argmax (as sampling it one by one would)."""
    vocab = 4
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0], [4.0, 3.5, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    metadata = verification_metadata([params], [[2]], [[]], [[0]], vocab, "cpu", [None])
    out = RejectionSampler()(logits, torch.tensor([0]), torch.tensor([1]), metadata)
    assert out.token_ids[0].tolist() == [0, 1]  # without the penalty on token 0 it would be [0, 0]


def test_mixed_batch_uneven_drafts_and_logprobs() -> None:
    """Greedy and sampled requests, 0..2 drafts each, logprobs of the emitted tokens from the
    raw logits of their rows."""
    vocab = 6
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0, logprobs=1),
              SamplingParams(temperature=0.0)]  # fmt: skip
    drafts = [[0, 1], [], [2]]
    logits = torch.cat([LOGITS, LOGITS[:1], LOGITS[:2]])
    metadata = verification_metadata(params, [[1]] * 3, [[]] * 3, drafts, vocab, "cpu", [None] * 3)
    out = RejectionSampler()(logits, torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1]), metadata)
    assert out.num_emitted.tolist()[0] == 3 and out.num_emitted.tolist()[1] == 1
    assert out.token_ids[2].tolist()[:1] == [0]  # draft 2 rejected by the argmax 0
    raw = torch.log_softmax(logits, dim=1)
    lp = out.logprobs_tensors
    assert lp is not None
    for row, token in [(0, 0), (1, 1), (2, argmax := int(LOGITS[2].argmax()))]:
        assert lp.token_ids[row, 0] == token
        assert torch.isclose(lp.logprobs[row, 0], raw[row, token])
    assert argmax == 0


def test_seeded_requests_do_not_depend_on_the_batch() -> None:
    vocab = 6
    params = SamplingParams(temperature=1.0, seed=11)

    def run(batch_drafts: list[list[int]]) -> list[int]:
        n = len(batch_drafts)
        logits = torch.cat([LOGITS[: len(d) + 1] for d in batch_drafts])
        metadata = verification_metadata([params] * n, [[1]] * n, [[]] * n, batch_drafts, vocab, "cpu", [None] * n)
        gen = torch.Generator().manual_seed(5)
        flat = torch.tensor([t for d in batch_drafts for t in d])
        out = RejectionSampler()(logits, flat, torch.tensor([len(d) for d in batch_drafts]), metadata,
                                 generators={0: gen})  # fmt: skip
        return out.token_ids[0, : int(out.num_emitted[0])].tolist()

    alone = run([[3, 4]])
    assert run([[3, 4], [0, 1]]) == alone  # another request with as many drafts
    assert run([[3, 4], [0]]) == alone  # fewer drafts beside it
