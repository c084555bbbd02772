"""The contract of a logits processor plugin (the ``kvloom.logits_processors`` entry-point
group); ``kvloom.sample.logits_processors`` finds the processors a request asks for.

A request asks for a processor by naming it in ``SamplingParams.extra_args`` (the server's
``vllm_xargs``): ``extra_args={"NAME": value}``. The processor checks the value when the
request is made (``parse_args``: a bad value is a ``ValueError``, an HTTP 400 naming the
field) and, every step, changes the logits of the batch's rows that asked for it, all of
them in one call (``apply``). It runs in the sampler, on the step's logits: after the
model's forward (outside CUDA graphs), after the grammar bitmask, ``logit_bias``, the
penalties and ``min_tokens``, before temperature and the draw. The logprobs a request
gets stay the model's.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class LogitsProcessorRow:
    """One request's row, as a processor sees it."""

    args: Any
    """What ``parse_args`` made of the request's ``extra_args[NAME]``."""
    prompt_token_ids: Sequence[int]
    """The request's prompt."""
    output_token_ids: Sequence[int]
    """Its output so far; under async scheduling the token of the step still in flight is
    ``-1`` (its count is exact)."""


class LogitsProcessor(abc.ABC):
    """Changes the logits of the requests that ask for it (``extra_args={name: value}``).
    ``name`` is the entry-point name and the ``extra_args`` key. One instance per model
    runner (per GPU), made when the engine starts."""

    name: ClassVar[str]
    """The entry-point name, and the ``extra_args`` key a request names it with."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        """``vocab_size``: the logits' width; ``device``: where they are."""
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    @abc.abstractmethod
    def parse_args(cls, value: Any) -> Any:
        """Check a request's ``extra_args[name]`` (a JSON value) and return what ``apply``
        gets for its row (``LogitsProcessorRow.args``). Raise ``ValueError`` saying what is
        wrong and what is allowed; the message is shown to the client prefixed with the
        field (``vllm_xargs.NAME: ...``). Runs where the request is made and again in
        the engine; keep it cheap and deterministic."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsProcessorRow]) -> torch.Tensor:
        """The processed logits (float32 ``[len(rows), vocab_size]``, on ``self.device``) of
        the rows that asked for this processor, in ``rows``' order. May change ``logits``
        in place and return it. A ``-inf`` everywhere in a row leaves it nothing to sample:
        keep at least one token finite."""
