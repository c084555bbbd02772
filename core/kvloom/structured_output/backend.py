"""The contract of a structured-output backend (a grammar library: xgrammar built in;
llguidance, outlines-core, ... as plugins in the ``kvloom.structured_output_backends``
entry-point group).

A backend turns a request's ``StructuredOutputsParams`` into a ``StructuredOutputGrammar``:
a per-request matcher that accepts the tokens the request generates, says which tokens
may come next as a bitmask (xgrammar's layout: int32 words, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed, as vLLM uses whatever the backend), can roll
back tokens and says when the grammar has terminated. The engine core compiles grammars
in a thread pool (``StructuredOutputManager``), so ``compile`` may take its time and must
be thread-safe; the matcher methods run on the engine core's thread.
"""

from __future__ import annotations

import abc
import re
from typing import Any, ClassVar

import torch

from kvloom.sampling_params import StructuredOutputsParams


def clean_error(exc: BaseException) -> str:
    """An exception's message without xgrammar's "[time] file.cc:line:" prefixes."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines())
    return re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", text) or type(exc).__name__


class StructuredOutputGrammar(abc.ABC):
    """One request's grammar state (a matcher over a compiled grammar)."""

    @abc.abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and nothing of the rest accepted) at the
        first token the grammar does not allow."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of ``bitmask`` (int32, CPU)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has ended (its stop token accepted): the request is done."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to the start state, no token accepted."""

    @property
    @abc.abstractmethod
    def num_processed_tokens(self) -> int:
        """Tokens accepted so far (minus those rolled back)."""


class StructuredOutputBackend(abc.ABC):
    """A grammar library. ``name`` is what ``--structured-outputs-backend`` selects (and
    the entry-point name of a plugin backend)."""

    name: ClassVar[str]
    """What ``--structured-outputs-backend`` selects (a plugin's entry-point name)."""

    @classmethod
    @abc.abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the problem if ``params`` cannot be compiled (a bad
        JSON schema, regex or grammar). Runs in the front end, without a tokenizer, so a
        bad request is refused (an HTTP 400) before it reaches the engine core."""

    @abc.abstractmethod
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        """``tokenizer``: the model's transformers tokenizer; ``vocab_size``: the model's
        (logits) vocabulary, which may be larger than the tokenizer's."""

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile ``params`` (thread-safe; runs in the manager's thread pool). The result
        is cached by the manager and given to ``new_grammar`` once per request."""

    @abc.abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher over a compiled grammar."""

    def allocate_bitmask(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """An int32 bitmask of ``num_rows`` rows covering ``vocab_size`` tokens, all
        allowed."""
        return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
