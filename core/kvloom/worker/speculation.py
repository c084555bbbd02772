"""The model runner's part for speculative decoding: verify the step's drafts, then draft
for the next step (``docs/speculative_decoding.md``).

A step with drafts computes logits at every verified position (``StepBatch.drafts``:
request i's last 1 + m_i tokens). ``StepSpeculation.sample`` then:

1. masks them with the grammar's bitmask, a row per position (structured requests);
2. samples the requests without drafts with the plain sampler (``StepSampler``, exactly as
   without speculation) and verifies the others with the rejection sampler
   (``kvloom.sample.rejection_sampler``): their accepted drafts plus one token each;
3. appends the emitted tokens to the input batch and asks the proposer for the next
   drafts: a ``HostProposer`` on the host from the token ids, a ``ModelProposer`` through
   the ``DraftRunner`` (its draft model, its KV cache beside the target's);
4. returns the step complete, its drafts in ``ModelRunnerOutput.spec_token_ids``.

The step is synchronous: the next step's drafts follow this step's accepted tokens, so the
engine core does not schedule ahead while speculating (``Scheduler.can_schedule_ahead``).
A request whose own sampling or verification fails fails alone (``RequestFailures``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from kvloom.config import EngineConfig
from kvloom.outputs import PendingModelRunnerOutput, TokenLogprobs
from kvloom.sample.rejection_sampler import RejectionSampler, verification_metadata
from kvloom.scheduler.output import SchedulerOutput
from kvloom.spec_decode.proposer import HostProposer, ModelProposer, ProposalRequest, Proposals
from kvloom.structured_output.bitmask import apply_bitmask_rows
from kvloom.worker.input_batch import CachedRequestState, InputBatch
from kvloom.worker.request_failures import RequestFailures
from kvloom.worker.step_output import StepOutputs, UnsampledStep
from kvloom.worker.step_sampler import StepSampler, step_seed

logger = logging.getLogger(__name__)


class StepSpeculation:
    """Verification and proposing for the model runner (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        input_batch: InputBatch,
        sampler: StepSampler,
        outputs: StepOutputs,
        failures: RequestFailures,
    ) -> None:
        speculative = config.speculative
        assert speculative is not None and speculative.proposer is not None
        self.config = config
        self.device = device
        self.input_batch = input_batch
        self.sampler = sampler
        self.outputs = outputs
        self.failures = failures
        self.k = speculative.num_speculative_tokens
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        self.proposer = speculative.proposer(config)
        self.rejection = RejectionSampler(sampler.sampler)
        # Per request: the distribution its pending drafts were drawn from (proposers that
        # sample their drafts); absent: deterministic drafts.
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.drafter: Any = None  # the DraftRunner of a ModelProposer

    # ------------------------------------------------------------------ set-up
    def load(self, target_model: nn.Module, loader: Callable[..., nn.Module]) -> list[nn.Module]:
        """Build a ``ModelProposer``'s draft model beside ``target_model``; its attention
        layers (which get KV-cache blocks beside the target's). None for host proposers."""
        if not isinstance(self.proposer, ModelProposer):
            return []
        from kvloom.worker.draft_runner import DraftRunner

        self.drafter = DraftRunner(self.config, self.device, self.proposer, self.input_batch, target_model, loader)
        return self.drafter.attn_layers

    def bind_kv_cache(self, make_builder: Callable[[list[nn.Module]], Any]) -> None:
        """The draft model's attention metadata builder, once the KV cache exists."""
        if self.drafter is not None:
            self.drafter.builder = make_builder(self.drafter.attn_layers)

    def profile_run(self, make_builder: Callable[[list[nn.Module]], Any], num_tokens: int, num_reqs: int) -> None:
        """The draft model's share of the memory profile (a forward at the largest batch)."""
        if self.drafter is not None:
            self.drafter.profile_run(make_builder, num_tokens, num_reqs)

    # ------------------------------------------------------------------ a step
    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Forget finished requests; write the drafts to verify after their requests' tokens."""
        finished = list(scheduler_output.finished_req_ids)
        if finished:
            for req_id in finished:
                self._draft_probs.pop(req_id, None)
            self.proposer.remove_requests(finished)
            if self.drafter is not None:
                self.drafter.remove_requests(finished)
        batch = self.input_batch
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if req_id in batch and req_id not in self.failures:
                batch.write_drafts(batch[req_id], drafts)

    def sample(self, step: UnsampledStep, rows: dict[str, int], bitmask: torch.Tensor | None) -> PendingModelRunnerOutput:
        """Verify, sample, propose; the step's complete output (see the module docstring)."""
        batch, logits = step.batch, step.logits
        assert logits is not None
        states = batch.states
        b = len(states)
        drafts = batch.drafts or [[] for _ in states]
        num_drafts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=b)
        first_row = np.cumsum(num_drafts + 1) - (num_drafts + 1)
        if bitmask is not None:
            logits = logits.float()
            logit_rows, mask_rows = [], []
            for i, s in enumerate(states):
                if (first := rows.get(s.req_id)) is not None:
                    logit_rows.extend(range(int(first_row[i]), int(first_row[i] + num_drafts[i] + 1)))
                    mask_rows.extend(range(first, first + int(num_drafts[i]) + 1))
            apply_bitmask_rows(logits, logit_rows, mask_rows, bitmask)
        done_prefill = [seq_len >= s.num_tokens for seq_len, s in zip(batch.seq_lens.tolist(), states)]
        sampling = [i for i, s in enumerate(states) if s.sampling_params is not None and done_prefill[i]]
        tokens: list[list[int]] = [[] for _ in states]
        logprobs: list[list[TokenLogprobs] | None] = [None] * b
        plain = [i for i in sampling if num_drafts[i] == 0]
        if plain:
            self._sample_plain(logits, states, plain, first_row, tokens, logprobs)
        verify = [i for i in sampling if num_drafts[i] > 0]
        if verify:
            self._verify_isolated(logits, states, verify, drafts, first_row, tokens, logprobs)
        for i in sampling:
            for token_id in tokens[i]:
                self.input_batch.append_token(states[i], token_id)
        proposals = self._propose(step, tokens, done_prefill)
        output = self.outputs.assemble(batch, step.hidden, done_prefill, tokens, logprobs, has_pooling=False)
        output.spec_token_ids = proposals + [[] for _ in batch.failed_req_ids]
        return PendingModelRunnerOutput.done(output)

    def _sample_plain(self, logits: torch.Tensor, states: list[CachedRequestState], plain: list[int],
                      first_row: np.ndarray, tokens: list[list[int]], logprobs: list[Any]) -> None:  # fmt: skip
        """Requests without drafts: the plain sampler on their one row, as without speculation."""
        index = torch.as_tensor(first_row[plain], device=logits.device)
        # No token is ever in flight: with speculation steps do not overlap (async scheduling off).
        out, kept = self.sampler.sample(logits[index], [states[i] for i in plain], list(range(len(plain))),
                                        lambda _states: None)  # fmt: skip
        sampled = out.sampled_token_ids.tolist()
        row_logprobs = out.logprobs_lists()
        for j, row in enumerate(kept):
            tokens[plain[row]] = [sampled[j]]
            if row_logprobs is not None:
                logprobs[plain[row]] = row_logprobs[j]

    def _verify_isolated(self, logits: torch.Tensor, states: list[CachedRequestState], verify: list[int],
                         drafts: list[list[int]], first_row: np.ndarray, tokens: list[list[int]],
                         logprobs: list[Any]) -> None:  # fmt: skip
        """Verify the requests with drafts together; if that fails, one by one, so that the
        requests at fault fail alone (``RequestFailures``)."""
        try:
            self._verify(logits, states, verify, drafts, first_row, tokens, logprobs)
        except Exception:
            at_fault = [i for i in verify if self.failures.run(states[i].req_id, "verifying its draft tokens",
                        self._verify, logits, states, [i], drafts, first_row, tokens, logprobs) is None]  # fmt: skip
            if len(at_fault) == len(verify) and len(verify) > 1:
                raise  # no single request reproduces it: the step's own failure
            logger.warning("Verifying drafts failed for requests %s", [states[i].req_id for i in at_fault])

    def _verify(self, logits: torch.Tensor, states: list[CachedRequestState], verify: list[int],
                drafts: list[list[int]], first_row: np.ndarray, tokens: list[list[int]],
                logprobs: list[Any]) -> bool:  # fmt: skip
        """Rejection-sample the requests ``verify`` (indices into ``states``); their tokens and
        logprobs go into ``tokens``/``logprobs``."""
        device = logits.device
        vstates = [states[i] for i in verify]
        vdrafts = [drafts[i] for i in verify]
        counts = [len(d) for d in vdrafts]
        rows = np.concatenate([np.arange(first_row[i], first_row[i] + len(drafts[i]) + 1) for i in verify])
        metadata = verification_metadata(
            [s.sampling_params for s in vstates], [s.prompt_token_ids for s in vstates],  # type: ignore[misc]
            [s.output_token_ids for s in vstates], vdrafts, logits.shape[1], device, [s.eos_token_id for s in vstates],
        )  # fmt: skip
        generators = {}
        for j, s in enumerate(vstates):
            if s.generator is not None:
                s.generator.manual_seed(step_seed(s.sampling_params.seed, len(s.output_token_ids)))  # type: ignore[union-attr,arg-type]
                generators[j] = s.generator
        out = self.rejection(
            logits[torch.as_tensor(rows, device=device)],
            torch.as_tensor([t for d in vdrafts for t in d], dtype=torch.long, device=device),
            torch.as_tensor(counts, dtype=torch.long, device=device),
            metadata, self._draft_probs_of(vstates, vdrafts, logits.shape[1]), generators,
        )  # fmt: skip
        token_ids, emitted = out.token_ids.tolist(), out.num_emitted.tolist()
        row_logprobs = out.logprobs_tensors.to_lists(metadata.num_logprobs) if out.logprobs_tensors is not None else None
        starts = out.row_start.tolist()
        for j, i in enumerate(verify):
            tokens[i] = token_ids[j][: emitted[j]]
            if row_logprobs is not None and vstates[j].sampling_params.logprobs is not None:  # type: ignore[union-attr]
                logprobs[i] = [lp for lp in row_logprobs[starts[j] : starts[j] + emitted[j]] if lp is not None]
        return True

    def _draft_probs_of(self, states: list[CachedRequestState], drafts: list[list[int]], vocab: int) -> torch.Tensor | None:
        """``[sum(m_i), vocab]`` draft distributions of the verified drafts (one-hot for
        deterministic ones), or None when every draft is deterministic."""
        if not any(s.req_id in self._draft_probs for s in states):
            return None
        parts = []
        for s, d in zip(states, drafts):
            probs = self._draft_probs.get(s.req_id)
            if probs is not None and probs.shape[0] >= len(d):
                parts.append(probs[: len(d)].to(self.device, torch.float32))
            else:
                one_hot = torch.zeros(len(d), vocab, device=self.device)
                one_hot[torch.arange(len(d)), torch.as_tensor(d)] = 1.0
                parts.append(one_hot)
        return torch.cat(parts)

    # ------------------------------------------------------------------ proposing
    def _propose(self, step: UnsampledStep, tokens: list[list[int]], done_prefill: list[bool]) -> list[list[int]]:
        """The next step's drafts of each request of the step ([] for none)."""
        states = step.batch.states
        wants = [i for i, s in enumerate(states) if tokens[i] and s.req_id not in self.failures]
        room = {i: min(self.k, self.max_model_len - states[i].num_tokens - 1) for i in wants}
        drafts: list[list[int]] = [[] for _ in states]
        if isinstance(self.proposer, HostProposer):
            requests = [ProposalRequest(states[i].req_id, self._tokens_of(states[i]), max(room[i], 0)) for i in wants]
            result = self.proposer.propose(requests) if requests else []
        else:
            result = self.drafter.propose(step, tokens, done_prefill, wants, room)
        proposals = result if isinstance(result, Proposals) else Proposals(list(result))
        if len(proposals.token_ids) != len(wants):
            raise RuntimeError(f"proposer {self.proposer.NAME!r} returned drafts for {len(proposals.token_ids)} "
                               f"requests, asked for {len(wants)}")  # fmt: skip
        for n, i in enumerate(wants):
            req_id, request_drafts = states[i].req_id, [int(t) for t in proposals.token_ids[n]]
            if len(request_drafts) > max(room[i], 0) or any(not 0 <= t < self.vocab_size for t in request_drafts):
                raise RuntimeError(f"proposer {self.proposer.NAME!r} returned drafts {request_drafts} for request "
                                   f"{req_id}: at most {max(room[i], 0)} token ids below {self.vocab_size} allowed")  # fmt: skip
            drafts[i] = request_drafts
            probs = proposals.probs[n] if proposals.probs is not None else None
            if probs is not None and request_drafts:
                self._draft_probs[req_id] = probs
            else:
                self._draft_probs.pop(req_id, None)
        return drafts

    def _tokens_of(self, state: CachedRequestState) -> np.ndarray:
        """The request's known tokens, read-only (a view of its input-batch row)."""
        view = self.input_batch.token_ids[state.row, : min(state.num_tokens, self.max_model_len)]
        view.flags.writeable = False
        return view
