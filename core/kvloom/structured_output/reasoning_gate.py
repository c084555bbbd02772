"""Where each structured request's grammar starts when the server runs a reasoning parser.

vLLM's ``enable_in_reasoning`` semantics: by default a reasoning model reasons freely and
the grammar binds only the answer, from the token after the reasoning's end marker; with
``enable_in_reasoning`` (or without a reasoning parser) the grammar binds the whole output.
Until a request's answer starts its bitmask row allows every token and its matcher sees
no token; from then on the matcher follows the output tokens after the marker.

Where the output starts comes from the prompt (``ReasoningParser.prompt_state``): inside
the reasoning (DeepSeek-R1's template opens it), after it (Qwen3's ``enable_thinking=False``
closes it), or undecided (Qwen3: the model opens it with ``<think>`` or answers at once).
An undecided request's first token is sampled from the grammar's tokens plus the start
marker: the start marker opens the reasoning, anything else is the first token of an
answer the grammar binds from its start, as the front end reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvloom.reasoning.base import ReasoningParser, ReasoningState

if TYPE_CHECKING:
    from kvloom.request import Request


class ReasoningGate:
    """The answer's start in each structured request's output (``parser`` None: every
    grammar starts at the first output token)."""

    def __init__(self, parser: ReasoningParser | None) -> None:
        self.parser = parser
        self._start: dict[str, int | None] = {}  # output index of the answer's first token; None: reasoning
        self._scanned: dict[str, int] = {}  # output tokens already searched for the end marker
        self._undecided: set[str] = set()  # no output yet, and it may open the reasoning

    def add(self, request: "Request") -> None:
        request_id = request.request_id
        state = ReasoningState.ENDED if self.parser is None else self.parser.prompt_state(request.prompt_token_ids)
        self._start[request_id] = None if state is ReasoningState.REASONING else 0
        self._scanned[request_id] = 0
        if state is ReasoningState.MAY_START:
            self._undecided.add(request_id)

    def remove(self, request_id: str) -> None:
        self._start.pop(request_id, None)
        self._scanned.pop(request_id, None)
        self._undecided.discard(request_id)

    def answer_start(self, request: "Request") -> int | None:
        """Where the grammar starts in ``request``'s output as it stands (None: still reasoning)."""
        request_id = request.request_id
        output = request.output_token_ids
        if request_id in self._undecided and output:
            self._undecided.discard(request_id)
            assert self.parser is not None
            if output[0] == self.parser.start_token_id:
                self._start[request_id], self._scanned[request_id] = None, 1
        if self._start[request_id] is None and len(output) > self._scanned[request_id]:
            assert self.parser is not None
            scanned = self._scanned[request_id]
            offset = self.parser.reasoning_end_offset(output[scanned:])
            if offset is not None:
                self._start[request_id] = scanned + offset
            self._scanned[request_id] = len(output)
        return self._start[request_id]

    def widen(self, request: "Request", bitmask: torch.Tensor, row: int) -> None:
        """Also allow, in ``row`` of ``bitmask`` (the grammar's tokens), the start marker of a
        request whose first token may open the reasoning."""
        if request.request_id in self._undecided and not request.output_token_ids:
            assert self.parser is not None
            token_id = self.parser.start_token_id
            bitmask[row, token_id // 32] |= torch.bitwise_left_shift(torch.ones((), dtype=torch.int32), token_id % 32)
