"""A step's outputs: sampled tokens on their way to the host, and what is computed once
they are there (prompt logprobs, pooling), gathered into a ``ModelRunnerOutput``.

Async scheduling: the runner returns a step as soon as it is launched. Its sampled
tokens are copied into pinned host memory behind an event (two buffers alternate, as
two steps can be in flight), each sampling request holds a placeholder token (-1) in the
input batch, and ``AsyncModelRunnerOutput.get_output()`` waits for the copy, writes the
tokens over the placeholders and finishes the step's results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvloom.config import EngineConfig
from kvloom.outputs import ModelRunnerOutput, PendingModelRunnerOutput, TokenLogprobs
from kvloom.pooling.pooler import pool_request
from kvloom.sample.sampler import SamplerOutput, compute_prompt_logprobs
from kvloom.worker.input_batch import CachedRequestState, InputBatch, Placeholders
from kvloom.worker.request_failures import RequestFailures
from kvloom.worker.step_inputs import StepBatch


@dataclass
class UnsampledStep:
    """A step whose forward ran (on the device, maybe still running) and whose logits wait
    to be masked and sampled (``ModelRunner.sample_tokens``)."""

    batch: StepBatch
    logits: torch.Tensor | None
    hidden: torch.Tensor | None


@dataclass
class InFlightTokens:
    """The tokens one step sampled, on their way to the host."""

    sampler_output: SamplerOutput
    #: Pinned host rows the tokens are copied into (row j: the step's j-th sampling request).
    host: torch.Tensor
    #: Recorded behind the copy on CUDA; None where the copy is synchronous.
    copied: torch.cuda.Event | None
    #: Per request that produced a token: its index in the batch, its row in ``host``,
    #: and its placeholder.
    batch_index: list[int]
    sample_rows: list[int]
    placeholders: Placeholders


class StepOutputs:
    """Turns launched steps into ``ModelRunnerOutput``s (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        input_batch: InputBatch,
        failures: RequestFailures,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.config = config
        self.input_batch = input_batch
        self.failures = failures
        self.compute_logits = compute_logits
        #: A classification model's head over pooled hidden states (set once the model is loaded).
        self.classify: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.pin_memory = device.type == "cuda"
        b = config.scheduler.max_num_seqs
        self._sampled_host = [torch.zeros(b, dtype=torch.int64, pin_memory=self.pin_memory) for _ in range(2)]
        self._sampled_slot = 0

    def copy_to_host(
        self, out: SamplerOutput, gen_idx: list[int], done_prefill: list[bool], states: list[CachedRequestState]
    ) -> InFlightTokens:
        """Start copying the tokens sampled for the rows ``gen_idx`` to the host; each
        request that produces one (its prefill done) gets a placeholder until it lands."""
        sampled_host = self._sampled_host[self._sampled_slot][: len(gen_idx)]
        self._sampled_slot ^= 1
        sampled_host.copy_(out.sampled_token_ids, non_blocking=self.pin_memory)
        copied: torch.cuda.Event | None = None
        if self.pin_memory:
            copied = torch.cuda.Event()
            copied.record()
        sample_rows = [j for j, i in enumerate(gen_idx) if done_prefill[i]]
        batch_index = [gen_idx[j] for j in sample_rows]
        placeholders = self.input_batch.append_placeholders([states[i] for i in batch_index])
        return InFlightTokens(out, sampled_host, copied, batch_index, sample_rows, placeholders)

    def pending(
        self, batch: StepBatch, hidden: torch.Tensor | None, done_prefill: list[bool], tokens: InFlightTokens | None
    ) -> AsyncModelRunnerOutput:
        has_pooling = any(s.pooling_params is not None for s in batch.states)
        return AsyncModelRunnerOutput(self, batch, hidden, done_prefill, tokens, has_pooling)

    @torch.inference_mode()
    def finish(
        self,
        batch: StepBatch,
        hidden: torch.Tensor | None,
        done_prefill: list[bool],
        tokens: InFlightTokens | None,
        has_pooling: bool,
    ) -> ModelRunnerOutput:
        """Wait for the tokens, write them over their placeholders (unless the request left
        the batch meanwhile) and gather the step's results."""
        states = batch.states
        sampled_lists: list[list[int]] = [[] for _ in states]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(states)
        if tokens is not None:
            if tokens.copied is not None:
                tokens.copied.synchronize()
            host = tokens.host.tolist()
            # The rows of ``host`` that produced a token: all of them, or a subset in order.
            token_ids = host if len(tokens.sample_rows) == len(host) else [host[j] for j in tokens.sample_rows]
            self.input_batch.set_tokens(tokens.placeholders, token_ids)
            if len(tokens.batch_index) == len(states):  # every request produced one (a decode step)
                sampled_lists = [[token_id] for token_id in token_ids]
            else:
                for i, token_id in zip(tokens.batch_index, token_ids):
                    sampled_lists[i] = [token_id]
            row_logprobs = tokens.sampler_output.logprobs_lists()
            if row_logprobs is not None:
                for i, j in zip(tokens.batch_index, tokens.sample_rows):
                    logprobs[i] = row_logprobs[j]
        return self.assemble(batch, hidden, done_prefill, sampled_lists, logprobs, has_pooling, tokens is not None)

    def assemble(
        self,
        batch: StepBatch,
        hidden: torch.Tensor | None,
        done_prefill: list[bool],
        sampled_lists: list[list[int]],
        logprobs: list[list[TokenLogprobs] | None],
        has_pooling: bool,
        sampled: bool = True,
    ) -> ModelRunnerOutput:
        """The step's ``ModelRunnerOutput`` from its tokens and logprobs per request (on the
        host, in the input batch already): prompt logprobs, pooling, the failed requests."""
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        pooler_output: list[torch.Tensor | None] | None = None
        if sampled and batch.any_prompt_logprobs:
            self._prompt_logprobs(batch, hidden, prompt_logprobs)
        if has_pooling:
            pooler_output = self._pool(batch, hidden, done_prefill)
        # Requests whose own work failed (before the step or in it) report no result.
        failed = self.failures.of([*batch.req_ids, *batch.failed_req_ids])
        req_ids = batch.req_ids
        if batch.failed_req_ids:
            req_ids = [*req_ids, *batch.failed_req_ids]
            sampled_lists += [[] for _ in batch.failed_req_ids]
            logprobs += [None] * len(batch.failed_req_ids)
            if pooler_output is not None:
                pooler_output += [None] * len(batch.failed_req_ids)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs=prompt_logprobs,
            pooler_output=pooler_output,
            failed=failed,
        )

    def _prompt_logprobs(
        self, batch: StepBatch, hidden: torch.Tensor | None, out: dict[str, list[TokenLogprobs]]
    ) -> None:
        """Logprobs of prompt tokens 1..P-1 computed in this step's chunk."""
        start_of = np.zeros(len(batch.states) + 1, dtype=np.int64)
        np.cumsum(batch.query_lens, out=start_of[1:])
        for i, s in enumerate(batch.states):
            params = s.sampling_params
            if params is None or params.prompt_logprobs is None or hidden is None or s.req_id in self.failures:
                continue
            first_pos = int(batch.seq_lens[i] - batch.query_lens[i])
            # token at position p predicts prompt token p+1; only prompt targets count
            last_pos = min(int(batch.seq_lens[i]), s.num_prompt_tokens - 1)
            if last_pos <= first_pos:
                continue
            result = self.failures.run(s.req_id, "computing its prompt logprobs", self._prompt_logprobs_of,
                                       s, hidden, int(start_of[i]), first_pos, last_pos)  # fmt: skip
            if result is not None:
                out[s.req_id] = result

    def _prompt_logprobs_of(
        self, s: CachedRequestState, hidden: torch.Tensor, start: int, first_pos: int, last_pos: int
    ) -> list[TokenLogprobs]:
        assert s.sampling_params is not None
        idx = torch.arange(start, start + (last_pos - first_pos), device=hidden.device)
        targets = torch.as_tensor(s.prompt_token_ids[first_pos + 1 : last_pos + 1], device=hidden.device)
        logits = self.compute_logits(hidden[idx]).float()
        return compute_prompt_logprobs(logits, targets, s.sampling_params.prompt_logprobs)  # type: ignore[arg-type]

    def _pool(
        self, batch: StepBatch, hidden: torch.Tensor | None, done_prefill: list[bool]
    ) -> list[torch.Tensor | None]:
        results: list[torch.Tensor | None] = [None] * len(batch.states)
        if hidden is None:
            return results
        start = 0
        for i, s in enumerate(batch.states):
            n = int(batch.query_lens[i])
            if s.pooling_params is not None and s.req_id not in self.failures:
                chunk = hidden[start : start + n]
                results[i] = self.failures.run(s.req_id, "pooling", pool_request, self.config, s, chunk,
                                               done_prefill[i], self.classify)  # fmt: skip
            start += n
        return results


class AsyncModelRunnerOutput(PendingModelRunnerOutput):
    """A launched step (``ModelRunner.execute_model``) whose sampled tokens may still be
    on their way to the host. ``get_output()`` finishes it (``StepOutputs.finish``) once;
    later calls return the same output."""

    def __init__(
        self,
        outputs: StepOutputs,
        batch: StepBatch,
        hidden: torch.Tensor | None,
        done_prefill: list[bool],
        tokens: InFlightTokens | None,
        has_pooling: bool,
    ) -> None:
        self._outputs = outputs
        self._step: tuple[StepBatch, torch.Tensor | None, list[bool], InFlightTokens | None, bool] | None = (
            batch, hidden, done_prefill, tokens, has_pooling)  # fmt: skip
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._step is not None
            self._output = self._outputs.finish(*self._step)
            self._step = None  # the step's device tensors are no longer needed
        return self._output
