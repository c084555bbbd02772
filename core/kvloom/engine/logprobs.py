"""Logprobs in the front end: the engine core sends token ids and float logprobs
(``TokenLogprobs``); users get vLLM's list-of-dicts form, ``{token_id: Logprob}`` per
position, with each token's decoded text (as vLLM's ``vllm/v1/engine/logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvloom.engine.detokenizer import Tokenizer
from kvloom.outputs import Logprob, PromptLogprobs, SampleLogprobs, TokenLogprobs


class TokenDecoder:
    """Decodes single token ids for logprobs (``Logprob.decoded_token``), with a cache.

    Each id is decoded alone, special tokens included, as vLLM does; a token holding part
    of a multi-byte character decodes to replacement characters.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._cache[token_id] = text
        return text


class LogprobsAccumulator:
    """One request's sample and prompt logprobs, in vLLM's list-of-dicts form."""

    def __init__(self, decode: Callable[[int], str | None], num_logprobs: int | None, num_prompt_logprobs: int | None) -> None:
        self._decode = decode
        self.logprobs: SampleLogprobs | None = [] if num_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if num_logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [] if num_prompt_logprobs is not None else None
        self._num_prompt_logprobs_sent = 0

    def _as_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        # The chosen token first, then the top-N (a top-N token equal to the chosen one
        # keeps the chosen one's place).
        out: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in out:
                out[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=self._decode(token_id))
        return out

    def add_sample_logprobs(self, entries: list[TokenLogprobs]) -> None:
        if self.logprobs is None:
            return
        assert self.cumulative_logprob is not None
        for entry in entries:
            self.logprobs.append(self._as_dict(entry))
            self.cumulative_logprob += entry.logprobs[0]

    def add_prompt_logprobs(self, entries: list[TokenLogprobs]) -> None:
        if self.prompt_logprobs is None:
            return
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)  # the first prompt token has no logprob
        self.prompt_logprobs.extend(self._as_dict(e) for e in entries)

    def take_prompt_logprobs(self, delta: bool) -> PromptLogprobs | None:
        """All prompt logprobs, or for DELTA only those not yet delivered (None if none)."""
        if self.prompt_logprobs is None:
            return None
        if not delta:
            return list(self.prompt_logprobs)
        new = self.prompt_logprobs[self._num_prompt_logprobs_sent :]
        self._num_prompt_logprobs_sent = len(self.prompt_logprobs)
        return new or None
