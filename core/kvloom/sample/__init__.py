"""Sampling: per-step ``SamplingMetadata`` and the batched ``Sampler``."""

from kvloom.sample.metadata import SamplingMetadata, make_generator
from kvloom.sample.sampler import LogprobsTensors, Sampler, SamplerOutput, compute_prompt_logprobs

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "make_generator",
]
