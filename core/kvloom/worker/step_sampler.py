"""The sampler step of the model runner: seeded generators, the sampling tensors of a
batch (reused while the batch stays the same), per-request isolation of sampling
failures, and the warm-ups that compile the sampler's kernels before the first request.

Seeds: the noise for output token k of a seeded request depends only on (seed, k), so a
seeded request gives the same tokens whatever batch it is in and across preemptions.

Async scheduling: a request's newest token may still be on its way to the host (a
placeholder -1 in its outputs). Penalties count it all the same: the counts are built from
the host's tokens and the token in flight is added on the device (``InFlightTokens``,
``StepInputs.in_flight_tokens``), so penalised requests sample exactly as in synchronous
steps and keep the overlap.

Isolation: a batch whose sampling fails is sampled again row by row to find the
requests at fault; they fail (``RequestFailures``), the others are sampled again with
the same noise. A failure no single row reproduces is the step's own and propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvloom.layers.custom_ops import get_custom_op
from kvloom.sample.logits_processors import make_logits_processors
from kvloom.sample.metadata import SamplingMetadata
from kvloom.sample.sampler import Sampler, SamplerOutput
from kvloom.sampling_params import SamplingParams
from kvloom.worker.input_batch import CachedRequestState, InputBatch
from kvloom.worker.request_failures import RequestFailures

logger = logging.getLogger(__name__)


#: ``StepInputs.in_flight_tokens``: for a batch's request states, (indices of those whose
#: newest token is in flight, those tokens on the device), or None.
InFlightTokens = Callable[[list[CachedRequestState]], "tuple[list[int], torch.Tensor] | None"]


def step_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed for a seeded request's output token ``num_output_tokens``."""
    return (seed * 1_000_003 + num_output_tokens * 7_919 + 1) % (2**63 - 1)


class StepSampler:
    """Samples the generating rows of a step's logits (see the module docstring)."""

    def __init__(self, device: torch.device, vocab_size: int, input_batch: InputBatch, failures: RequestFailures) -> None:
        self.device = device
        self.input_batch = input_batch
        self.failures = failures
        # The logits processor plugins, one instance each for this runner (requests ask
        # for them through SamplingParams.extra_args).
        self.sampler = Sampler(logits_processors=make_logits_processors(vocab_size, device))
        # The last step's sampling tensors while they hold for the same rows: keyed by the
        # input batch's version and the rows' request ids (``_sample_rows``).
        self._metadata: tuple[tuple[int, tuple[str, ...]], SamplingMetadata] | None = None

    def make_generator(self, seed: int | None) -> torch.Generator | None:
        """A request's own generator (None for an unseeded request)."""
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed % (2**63))
        return gen

    def sample(
        self, logits: torch.Tensor, states: list[CachedRequestState], gen_idx: list[int], in_flight: InFlightTokens
    ) -> tuple[SamplerOutput, list[int]]:
        """Sample the rows ``gen_idx`` of ``logits``; returns the sampler's output and the
        rows it covers (those of requests that did not fail). ``in_flight`` gives the
        tokens still in flight that penalties count."""
        try:
            return self._sample_rows(logits, states, gen_idx, in_flight), gen_idx
        except Exception:
            run = self.failures.run
            at_fault = [i for i in gen_idx if run(states[i].req_id, "sampling", self._sample_rows, logits, states,
                                                  [i], in_flight) is None]  # fmt: skip
            if not at_fault:
                raise
            logger.warning("Sampling failed for requests %s; sampling the rest of the batch again",
                           [states[i].req_id for i in at_fault])  # fmt: skip
            kept = [i for i in gen_idx if i not in at_fault]
            if not kept:
                return SamplerOutput(torch.empty(0, dtype=torch.long, device=logits.device), None, []), []
            return self._sample_rows(logits, states, kept, in_flight), kept

    def _sample_rows(
        self, logits: torch.Tensor, states: list[CachedRequestState], rows: list[int], in_flight: InFlightTokens
    ) -> SamplerOutput:
        gen_states = [states[i] for i in rows]
        for s in gen_states:
            if s.generator is not None:
                s.generator.manual_seed(step_seed(s.sampling_params.seed, len(s.output_token_ids)))  # type: ignore[union-attr,arg-type]
        # The same requests in the same rows as the step before (a decode batch without
        # arrivals or departures) sample with the same tensors, unless they count tokens.
        key = (self.input_batch.version, tuple([s.req_id for s in gen_states]))
        if self._metadata is not None and self._metadata[0] == key:
            metadata = self._metadata[1]
        else:
            metadata = SamplingMetadata.build(
                params=[s.sampling_params for s in gen_states],  # type: ignore[misc]
                prompt_token_ids=[s.prompt_token_ids for s in gen_states],
                output_token_ids=[s.output_token_ids for s in gen_states],
                generators={j: s.generator for j, s in enumerate(gen_states) if s.generator is not None},
                vocab_size=logits.shape[-1],
                device=logits.device,
                eos_token_ids=[s.eos_token_id for s in gen_states],
            )
            self._metadata = (key, metadata) if metadata.reusable else None
            if metadata.output_token_counts is not None:
                _count_in_flight(metadata.output_token_counts, in_flight(gen_states))
        gen_logits = logits if len(rows) == len(states) else logits[torch.as_tensor(rows, device=logits.device)]
        # In the LM head's dtype: the sampler casts to float32 itself, except on its
        # random_sample fast path, which reads the logits as they are.
        return self.sampler(gen_logits, metadata)

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, logits: torch.Tensor, num_reqs: int) -> None:
        """A sampler pass over ``num_reqs`` rows with the memory-hungry features on
        (temperature, top-p, top-k, logprobs: part of the memory profile), then the
        platform's ``random_sample`` op once per kernel variant a run can meet."""
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)] * num_reqs
        metadata = SamplingMetadata.build(
            params=params,
            prompt_token_ids=[[0]] * num_reqs,
            output_token_ids=[[]] * num_reqs,
            generators={},
            vocab_size=logits.shape[-1],
            device=logits.device,
            eos_token_ids=[None] * num_reqs,
        )
        self.sampler(logits, metadata)  # it casts to float32 itself, as on every step
        self._warm_up_random_sample(logits, num_reqs)

    @staticmethod
    def _warm_up_random_sample(logits: torch.Tensor, num_reqs: int) -> None:
        """Run the platform's ``random_sample`` op (the sampler's fast path) with and
        without greedy rows, at one row and at the largest batch (kernels may split the
        vocabulary by batch size). Its first call per variant compiles it (Triton: ~0.5 s),
        which a step would otherwise pay: measured on the H100, the first nano-vllm run
        after start-up lost 5% to it."""
        op = get_custom_op("random_sample")
        if op is None:
            return
        for rows in sorted({1, num_reqs}):
            temperature = torch.ones(rows, dtype=torch.float32, device=logits.device)
            greedy = torch.zeros(rows, dtype=torch.bool, device=logits.device)
            op(logits[:rows], temperature, None)
            op(logits[:rows], temperature, greedy)


def _count_in_flight(counts: torch.Tensor, held: tuple[list[int], torch.Tensor] | None) -> None:
    """Add the tokens still in flight to the penalties' ``counts`` ([B, V]) on the device:
    row ``held[0][k]`` gets one more of token ``held[1][k]`` (at most one per row)."""
    if held is None:
        return
    rows, tokens = held
    index = torch.tensor(rows, dtype=torch.long).to(counts.device, non_blocking=True)
    counts.index_put_((index, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
