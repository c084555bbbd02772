"""A logits processor that forces a request's first output tokens (an answer "prefilled"
token by token): ``extra_args={"forced_tokens": [id, ...]}`` makes output token i the i-th id
of the list, then lets the model go on. Rows past their list are left alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvloom.interfaces import LogitsProcessor, LogitsProcessorRow

KVLOOM_PLUGIN_API = "1.1"

#: The longest list a request may force.
MAX_FORCED = 256


class ForcedTokens(LogitsProcessor):
    name = "forced_tokens"

    @classmethod
    def parse_args(cls, value: Any) -> list[int]:
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty list of token ids")
        if len(value) > MAX_FORCED:
            raise ValueError(f"{len(value)} tokens are too many (allowed: at most {MAX_FORCED})")
        for token_id in value:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"{token_id!r:.20} is not a token id (allowed: integers >= 0)")
        return value

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsProcessorRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            position = len(row.output_token_ids)  # exact also under async scheduling
            if position < len(row.args):
                token_id = row.args[position]
                if token_id >= self.vocab_size:
                    raise ValueError(f"forced_tokens: token id {token_id} is outside the vocabulary")
                logits[i] = float("-inf")
                logits[i, token_id] = 0.0
        return logits
