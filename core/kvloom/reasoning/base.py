"""The contract of a reasoning parser (``--reasoning-parser NAME``): it splits a reasoning
model's output into its reasoning (``<think> ... </think>``) and its answer, in the front end
(text, delta by delta) and in the engine core (token ids: the structured-output grammar
applies only after the reasoning ends). Built in: ``deepseek_r1`` and ``qwen3``; more come as
plugins of the ``kvloom.reasoning_parsers`` entry-point group.

A parser is configured by its class attributes (the two markers, each one token of the
model's vocabulary, and whether the model reasons without opening with the start marker);
the methods follow from them and may be overridden by a model with other rules.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


class ReasoningState(enum.Enum):
    """Where a request's output starts, as its prompt says (``ReasoningParser.prompt_state``)."""

    REASONING = "reasoning"
    """Inside the reasoning: everything up to the end marker is reasoning (a start marker the
    output opens with is dropped)."""
    ENDED = "ended"
    """After the reasoning (the prompt closed it, as Qwen3's template does with
    ``enable_thinking=False``): the whole output is the answer."""
    MAY_START = "may_start"
    """The output is the answer unless it opens with the start marker."""


@dataclass
class ReasoningDelta:
    """What a piece of output adds to the reasoning and to the answer (either may be empty)."""

    reasoning: str = ""
    """Reasoning text."""
    content: str = ""
    """Answer text."""


class ReasoningStream:
    """Splits one output into reasoning and answer as its text arrives (``feed``), so that
    the deltas of a stream add up to what ``feed(whole text)`` + ``finish()`` gives, wherever
    the text is cut: a tail that may be the beginning of a marker is held back until the
    next delta says what it is (or ``finish`` flushes it)."""

    def __init__(self, start_marker: str, end_marker: str, state: ReasoningState) -> None:
        self.start_marker = start_marker
        self.end_marker = end_marker
        # "opening": the output may still begin with the start marker; the phase it goes to
        # when it does not is ``_default``.
        self._phase = "content" if state is ReasoningState.ENDED else "opening"
        self._default = "reasoning" if state is ReasoningState.REASONING else "content"
        self._held = ""
        self.reasoned = False
        """Whether the output entered its reasoning."""

    @property
    def reasoning_ended(self) -> bool:
        """Whether everything from here on is the answer."""
        return self._phase == "content"

    def feed(self, text: str) -> ReasoningDelta:
        """What the next piece of output ``text`` adds to the reasoning and to the answer."""
        delta = ReasoningDelta()
        held = self._held + text
        self._held = ""
        if self._phase == "opening":
            opened = held.lstrip()
            if not opened or (len(opened) < len(self.start_marker) and self.start_marker.startswith(opened)):
                self._held = held  # blank so far, or the start marker's beginning
                return delta
            if opened.startswith(self.start_marker):
                self._phase, held = "reasoning", opened[len(self.start_marker) :]
            else:
                self._phase = self._default
            self.reasoned = self._phase == "reasoning"
        if self._phase == "reasoning":
            end = held.find(self.end_marker)
            if end < 0:
                keep = _partial_marker_len(held, self.end_marker)
                delta.reasoning, self._held = held[: len(held) - keep], held[len(held) - keep :]
                return delta
            delta.reasoning, held = held[:end], held[end + len(self.end_marker) :]
            self._phase = "content"
        delta.content = held
        return delta

    def finish(self) -> ReasoningDelta:
        """The text still held back, once the output has ended."""
        held, self._held = self._held, ""
        if self._phase == "opening":
            self._phase = self._default
            self.reasoned = self._phase == "reasoning"
        return ReasoningDelta(reasoning=held) if self._phase == "reasoning" else ReasoningDelta(content=held)


def _partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (shorter than it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def marker_token_id(tokenizer: Any, marker: str, parser: str) -> int:
    """The id of the one token that spells ``marker`` (a ``ValueError`` when there is none)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    token_id = vocab.get(marker)
    if token_id is None:
        raise ValueError(f"--reasoning-parser {parser}: the model's tokenizer has no token {marker!r} (this parser "
                         "is for models whose vocabulary has it, such as DeepSeek-R1 and Qwen3)")  # fmt: skip
    return int(token_id)


class ReasoningParser:
    """Splits a reasoning model's output into reasoning and answer. ``name`` is what
    ``--reasoning-parser`` selects (and a plugin's entry-point name); ``start_marker`` and
    ``end_marker`` delimit the reasoning and must each be one token of the model's
    vocabulary (their ids: ``start_token_id``, ``end_token_id``); ``reasoning_by_default``:
    whether the model reasons from its first token when neither the prompt nor the output
    opens the reasoning (DeepSeek-R1, whose template opens it; Qwen3 does not).

    Front end: ``stream(prompt_token_ids)`` splits one output delta by delta;
    ``extract_reasoning(text, prompt_token_ids)`` a whole one. Engine core (structured
    outputs): ``prompt_state`` says where the output starts, ``reasoning_end_offset`` where
    in newly sampled tokens the reasoning ends."""

    name: ClassVar[str]
    """What ``--reasoning-parser`` selects (a plugin's entry-point name)."""
    start_marker: ClassVar[str] = "<think>"
    """The token that opens the reasoning."""
    end_marker: ClassVar[str] = "</think>"
    """The token that closes it."""
    reasoning_by_default: ClassVar[bool] = False
    """Whether an output whose prompt does not open the reasoning starts inside it anyway."""

    def __init__(self, tokenizer: Any) -> None:
        """``tokenizer``: the model's transformers tokenizer (a ``ValueError`` when it lacks a
        marker token)."""
        self.tokenizer = tokenizer
        self.start_token_id = marker_token_id(tokenizer, self.start_marker, self.name)
        self.end_token_id = marker_token_id(tokenizer, self.end_marker, self.name)

    # ------------------------------------------------------------------ token ids (engine core)

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` (a prompt, or a prompt and output) close the reasoning: the
        last marker token among them is the end marker."""
        for token_id in reversed(token_ids):
            if token_id == self.end_token_id:
                return True
            if token_id == self.start_token_id:
                return False
        return False

    def prompt_state(self, prompt_token_ids: Sequence[int]) -> ReasoningState:
        """Where the output of a request with this prompt starts."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.end_token_id:
                return ReasoningState.ENDED
            if token_id == self.start_token_id:
                return ReasoningState.REASONING
        return ReasoningState.REASONING if self.reasoning_by_default else ReasoningState.MAY_START

    def reasoning_end_offset(self, new_token_ids: Sequence[int]) -> int | None:
        """Where the answer starts in ``new_token_ids``, tokens sampled inside the reasoning:
        the index after the end marker (None: the reasoning goes on)."""
        for i, token_id in enumerate(new_token_ids):
            if token_id == self.end_token_id:
                return i + 1
        return None

    # ------------------------------------------------------------------ text (front end)

    def stream(self, prompt_token_ids: Sequence[int] | None = None) -> ReasoningStream:
        """A splitter for one output of a request with this prompt (None: a prompt that
        neither opens nor closes the reasoning)."""
        state = self.prompt_state(prompt_token_ids or ())
        return ReasoningStream(self.start_marker, self.end_marker, state)

    def extract_reasoning(self, text: str, prompt_token_ids: Sequence[int] | None = None) -> tuple[str | None, str]:
        """The reasoning (None when the output has none) and the answer of a whole output."""
        splitter = self.stream(prompt_token_ids)
        parts = [splitter.feed(text), splitter.finish()]
        reasoning = "".join(p.reasoning for p in parts)
        return (reasoning if splitter.reasoned else None), "".join(p.content for p in parts)
