"""The rejection sampler of speculative decoding: the verified positions' logits and the
drafts in, each request's accepted drafts plus one token out, distributed exactly as if
the target had sampled every token itself.

A request with m drafts ``d_1..d_m`` has m + 1 consecutive rows of target logits: row j
(0-based) is the target's distribution for the token after ``d_1..d_j``. Each row is
processed as the plain sampler processes a row (logit_bias, penalties and min_tokens over
the output so far *with* the drafts before it, logits processors, grammar mask applied
by the runner; then temperature, top-k, top-p, min-p), giving p_j.

- Greedy requests: ``d_j`` is accepted while it is the argmax of row j - 1; the first
  mismatch is replaced by that argmax, and if every draft matches, the argmax of the last
  row is the bonus token. The output is token for token the non-speculative greedy output.
- Sampled requests (Leviathan et al., Chen et al.): ``d_j`` is accepted with probability
  ``min(1, p(d_j) / q(d_j))`` (q: the draft's distribution; one-hot for deterministic
  drafts, so the probability is p(d_j)). At the first rejection the token is drawn from
  the residual ``max(0, p - q)`` normalised; if every draft is accepted, a bonus token is
  drawn from the last row. The emitted sequence then has the target's distribution.

Seeded requests draw their acceptance uniforms and their final token from their own
generator (reproducible runs); the others from torch's default generator. Logprobs of the
emitted tokens come from the raw logits of their rows (as the plain sampler's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.sample.metadata import SamplingMetadata
from kvloom.sampling_params import SamplingParams
from kvloom.sample.sampler import (
    LogprobsTensors,
    Sampler,
    exponential_race,
    gather_logprobs,
    no_logit_processing,
    sampling_probs,
)


@dataclass
class RejectionOutput:
    """One verification step's result, per request (in the order given)."""

    token_ids: torch.Tensor
    """``[B, max_drafts + 1]`` long: the emitted tokens (accepted drafts, then the recovered
    or bonus token), -1 after them."""
    num_emitted: torch.Tensor
    """``[B]`` long: tokens emitted (accepted drafts + 1)."""
    logprobs_tensors: LogprobsTensors | None
    """Per row of the logits (position): the logprob of the token emitted there first; rows
    past a request's emitted tokens hold an arbitrary token. None when no request wants logprobs."""
    row_start: torch.Tensor
    """``[B]`` long: each request's first row in the logits."""


def verification_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    drafts: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
    eos_token_ids: list[int | None],
) -> SamplingMetadata:
    """The sampling metadata of the verified positions: request i's m_i + 1 rows, row j with
    its output so far plus its first j drafts (what penalties, min_tokens and logits
    processors read had the target sampled them itself)."""
    rows_params: list[SamplingParams] = []
    rows_prompt: list[list[int]] = []
    rows_output: list[list[int]] = []
    rows_eos: list[int | None] = []
    for p, prompt, out, d, eos in zip(params, prompt_token_ids, output_token_ids, drafts, eos_token_ids):
        for j in range(len(d) + 1):
            rows_params.append(p)
            rows_prompt.append(prompt)
            rows_output.append(out + d[:j] if j else out)
            rows_eos.append(eos)
    return SamplingMetadata.build(params=rows_params, prompt_token_ids=rows_prompt, output_token_ids=rows_output,
                                  generators={}, vocab_size=vocab_size, device=device, eos_token_ids=rows_eos)  # fmt: skip


def draft_layout(num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(first logits row of each request, first draft index of each request, max drafts)
    for requests with ``num_drafts`` [B] drafts (m + 1 logits rows each)."""
    rows = num_drafts + 1
    row_start = torch.cumsum(rows, 0) - rows
    draft_start = torch.cumsum(num_drafts, 0) - num_drafts
    return row_start, draft_start, int(num_drafts.max()) if num_drafts.numel() else 0


class RejectionSampler:
    """Verifies drafts against the target's logits (see the module docstring). It processes
    the logits with ``sampler``'s rules, so logits processor plugins apply as they do
    without speculation."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    def __call__(
        self,
        logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        metadata: SamplingMetadata,
        draft_probs: torch.Tensor | None = None,
        generators: dict[int, torch.Generator] | None = None,
    ) -> RejectionOutput:
        """``logits [T, V]`` (T = sum(m_i + 1)), ``draft_token_ids [D]`` (D = sum m_i, request
        by request), ``num_drafts [B]`` (on ``logits``' device), ``metadata``: one row per
        logits row (``SamplingMetadata.build`` with each row's output so far, drafts before
        it included); ``draft_probs [D, V]``: q of each draft (None: deterministic drafts);
        ``generators``: request index -> its generator (seeded requests)."""
        device = logits.device
        num_rows, vocab = logits.shape
        if int(num_drafts.sum()) + num_drafts.numel() != num_rows or draft_token_ids.numel() != num_rows - num_drafts.numel():
            raise ValueError(f"rejection sampler: {num_rows} logits rows and {draft_token_ids.numel()} drafts do not "
                             f"match num_drafts {num_drafts.tolist()} (each request has num_drafts + 1 rows)")  # fmt: skip
        row_start, draft_start, max_drafts = draft_layout(num_drafts)
        b = num_drafts.numel()
        # [B, K] index grids: request i's draft j (invalid past m_i, masked).
        j = torch.arange(max_drafts, device=device).unsqueeze(0)
        valid = j < num_drafts.unsqueeze(1)
        draft_index = (draft_start.unsqueeze(1) + j).clamp(max=max(draft_token_ids.numel() - 1, 0))
        drafts = draft_token_ids[draft_index] if draft_token_ids.numel() else torch.zeros_like(j).expand(b, 0)
        draft_rows = (row_start.unsqueeze(1) + j).clamp(max=num_rows - 1)

        if metadata.all_greedy and no_logit_processing(metadata):
            processed, raw_logprobs = logits, None
        else:
            processed, raw_logprobs = self.sampler.process_logits(logits, metadata)
        accepted = torch.zeros(b, max_drafts, dtype=torch.bool, device=device)
        final = torch.empty(b, dtype=torch.long, device=device)
        greedy = self._greedy_rows(metadata, row_start)
        if greedy is None or bool(greedy.any()):
            target = processed.argmax(dim=1)
            greedy_accepted = valid & (drafts == target[draft_rows])
            greedy_num = _leading_true(greedy_accepted)
            greedy_final = target[row_start + greedy_num]
            if greedy is None:
                accepted, final = greedy_accepted, greedy_final
            else:
                accepted = torch.where(greedy.unsqueeze(1), greedy_accepted, accepted)
                final = torch.where(greedy, greedy_final, final)
        if greedy is not None:
            probs = sampling_probs(processed, metadata)
            probs = probs / probs.sum(dim=1, keepdim=True).clamp_min(1e-30)
            rand_accepted, rand_final = self._sample(probs, drafts, valid, draft_rows, draft_index, row_start,
                                                     num_drafts, draft_probs, generators or {})  # fmt: skip
            accepted = torch.where(greedy.unsqueeze(1), accepted, rand_accepted)
            final = torch.where(greedy, final, rand_final)

        num_accepted = _leading_true(accepted)
        token_ids = torch.full((b, max_drafts + 1), -1, dtype=torch.long, device=device)
        if max_drafts:
            token_ids[:, :max_drafts] = torch.where(j < num_accepted.unsqueeze(1), drafts, -1)
        token_ids.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))

        logprobs_tensors = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            # The token emitted at each row: the draft where accepted, the final token at the
            # last emitted row (other rows are never read).
            emitted = torch.zeros(num_rows, dtype=torch.long, device=device)
            if max_drafts:
                emitted[draft_rows[valid]] = drafts[valid]
            emitted[row_start + num_accepted] = final
            logprobs_tensors = gather_logprobs(raw_logprobs, emitted, metadata.max_num_logprobs)
        return RejectionOutput(token_ids, num_accepted + 1, logprobs_tensors, row_start)

    @staticmethod
    def _greedy_rows(metadata: SamplingMetadata, row_start: torch.Tensor) -> torch.Tensor | None:
        """[B] bool, True for greedy requests; None when every request is greedy."""
        if metadata.all_greedy:
            return None
        if metadata.all_random:
            return torch.zeros(row_start.numel(), dtype=torch.bool, device=row_start.device)
        assert metadata.greedy_mask is not None
        return metadata.greedy_mask[row_start]

    @staticmethod
    def _sample(
        probs: torch.Tensor,
        drafts: torch.Tensor,
        valid: torch.Tensor,
        draft_rows: torch.Tensor,
        draft_index: torch.Tensor,
        row_start: torch.Tensor,
        num_drafts: torch.Tensor,
        draft_probs: torch.Tensor | None,
        generators: dict[int, torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled requests' acceptances [B, K] and final tokens [B]."""
        b, k = drafts.shape
        p_draft = probs[draft_rows, drafts] if k else probs.new_zeros(b, 0)
        q_draft = draft_probs[draft_index, drafts] if (draft_probs is not None and k) else torch.ones_like(p_draft)
        uniform = torch.rand(b, k, device=probs.device)
        if generators:
            # A seeded request draws exactly its own drafts' uniforms: the same whatever else is in the batch.
            counts = num_drafts.tolist()
            for i, generator in generators.items():
                uniform[i, : counts[i]].uniform_(generator=generator)
        accepted = valid & (uniform * q_draft < p_draft)
        num_accepted = _leading_true(accepted)
        # The final token's distribution: the row after the accepted drafts; where a draft
        # was rejected there, the residual max(0, p - q) (q one-hot: p without the draft).
        final_probs = probs[row_start + num_accepted].clone()
        rejected = num_accepted < num_drafts
        if bool(rejected.any()):
            at = num_accepted.clamp(max=max(k - 1, 0))
            rows = rejected.nonzero().squeeze(1)
            if draft_probs is not None:
                q = draft_probs[draft_index[rows, at[rows]]]
            else:
                q = torch.zeros_like(final_probs[rows])
                q.scatter_(1, drafts[rows, at[rows]].unsqueeze(1), 1.0)
            residual = (final_probs[rows] - q).clamp_min(0.0)
            mass = residual.sum(dim=1, keepdim=True)
            # p == q leaves no residual, but then a rejection has probability 0: keep p.
            final_probs[rows] = torch.where(mass > 0, residual, final_probs[rows])
        return accepted, exponential_race(final_probs, generators)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B] count of leading True values in each row of ``mask`` [B, K]."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    return torch.cumprod(mask.to(torch.long), dim=1).sum(dim=1)
