"""n-gram speculation (prompt lookup): drafts copied from the request's own context.

For a request with tokens ``t[0..L)``: among the earlier places where the context's last
``n`` tokens appeared before (``prompt_lookup_min <= n <= prompt_lookup_max``), take the
longest match, the most recent one among equally long ones, and propose the (up to k)
tokens that followed it. Extraction, summaries that quote, and code edits repeat their
input, so the target often accepts several drafts at once; on free text few match.

vLLM's rule (the longest n-gram, rightmost match; drafts stop at the context's end). It
runs on the host with numpy: the candidates are the earlier positions holding the last
token, and one comparison per n-gram length extends them all at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvloom.spec_decode.proposer import HostProposer, ProposalRequest

if TYPE_CHECKING:
    from kvloom.config import EngineConfig


def ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens following the most recent longest earlier occurrence of the last
    ``n`` tokens of ``tokens`` (``min_n <= n <= max_n``); empty when none matches."""
    length = tokens.shape[0]
    if k <= 0 or length < min_n + 1:
        return tokens[:0]
    last = tokens[-1]
    # Earlier positions ending a possible match (the last token's own position excluded).
    candidates = np.flatnonzero(tokens[: length - 1] == last)
    if candidates.size == 0:
        return tokens[:0]
    match_len = np.ones(candidates.size, dtype=np.int64)
    alive = np.ones(candidates.size, dtype=bool)
    for d in range(1, max_n):
        if length - 1 - d < 0:
            break
        before = candidates - d
        ok = alive & (before >= 0)
        ok[ok] = tokens[before[ok]] == tokens[length - 1 - d]
        alive = ok
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return tokens[:0]
    end = int(candidates[np.flatnonzero(match_len == best)[-1]])  # the most recent of the longest
    return tokens[end + 1 : end + 1 + k]


class NgramProposer(HostProposer):
    """``method: ngram``: prompt lookup on the host (see the module docstring)."""

    NAME: ClassVar[str] = "ngram"
    methods: ClassVar[tuple[str, ...]] = ("[ngram]",)

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        spec = self.speculative
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        return [ngram_drafts(r.token_ids, self.min_n, self.max_n, r.num_drafts).tolist() for r in requests]
