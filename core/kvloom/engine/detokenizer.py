"""Incremental detokenization and stop-string detection, per request, in the front end.

Decoding token by token with ``tokenizer.decode([id])`` is wrong twice over: a
multi-byte UTF-8 character split across tokens comes out as replacement characters,
and sentencepiece-style tokenizers drop a token's leading space when it is decoded
alone. So each step decodes a short window of ids (a few tokens of already-emitted
context plus the pending ones) and emits the text beyond the context's own decoding;
while the window's text ends with an incomplete character (U+FFFD) nothing is emitted
and the window grows until the character is complete. The first window starts with
the prompt's last few tokens so the first output token keeps its leading space.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvloom.sampling_params import SamplingParams

#: Prompt tokens used as decoding context for the first output token.
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that detokenization uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs) -> str: ...


def decode_ids(tokenizer: Tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    # clean_up_tokenization_spaces would rewrite " ." to "." across window boundaries,
    # so a window's text would stop being a prefix of the next one's.
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def window_decoder(tokenizer: Tokenizer) -> Callable[[list[int], bool], str]:
    """``decode_ids`` for ``tokenizer``, as cheap as it can be had: for a stock Hugging
    Face fast tokenizer, its ``tokenizers.Tokenizer`` directly (what the wrapper's decode
    calls when spaces are not cleaned up; the wrapper's argument handling costs ~4x the
    decode itself of a short window, twice per output token of every request). Any other
    tokenizer, or one whose class overrides decoding, goes through its own ``decode``."""
    from transformers import PreTrainedTokenizerFast  # here: importing transformers is slow

    backend = getattr(tokenizer, "backend_tokenizer", None)
    stock = isinstance(tokenizer, PreTrainedTokenizerFast) and all(
        getattr(type(tokenizer), name) is getattr(PreTrainedTokenizerFast, name) for name in ("decode", "_decode"))
    if stock and backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: decode_ids(tokenizer, ids, skip)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text and watches for stop strings.

    ``update`` takes each step's new token ids; ``get_next_output_text`` says what text
    to show. Without a tokenizer (``skip_tokenizer_init``) or with ``detokenize=False``
    it only collects token ids and the text stays empty.

    Stop strings: the earliest occurrence of any of them ends the request (``update``
    returns the string); the text is cut before it (after it with
    ``include_stop_str_in_output``) and later tokens of the same step are dropped. Until
    the request finishes, the last ``len(longest stop string) - 1`` characters are held
    back, so a partial stop string is never shown.

    A request that the engine core finished with a stop token (EOS or one of
    ``stop_token_ids``) keeps that token in ``token_ids`` but, as in vLLM, its text is
    not added unless ``include_stop_str_in_output``.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer if params.detokenize else None
        self._decode = window_decoder(self.tokenizer) if self.tokenizer is not None else None
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        if self.stop and self.tokenizer is None:
            reason = "detokenize=False" if tokenizer is not None else "the engine has no tokenizer"
            raise ValueError(f"stop: stop strings need detokenization, but {reason}")
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )

        self.token_ids: list[int] = []
        self.output_text = ""
        self._last_output_text_offset = 0

        # Decoding window over (prompt context + output ids).
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add a step's tokens. ``stop_terminated``: the core finished the request with
        its last token (EOS or a stop token id). Returns the stop string that ended the
        request, or None."""
        skipped_stop_token: int | None = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            skipped_stop_token = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]

        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            if self.tokenizer is None:
                continue
            new_text = self._decode_next(token_id)
            if not new_text:
                continue
            self.output_text += new_text
            if self.stop:
                stop_string = self._find_stop(len(new_text))
                if stop_string is not None:
                    return stop_string  # later tokens of this step are dropped

        if skipped_stop_token is not None:
            self.token_ids.append(skipped_stop_token)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: everything (``delta=False``) or only what is new since
        the last call (``delta=True``), minus the stop-string hold-back until finished."""
        hold_back = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - hold_back, 0)
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if end <= start:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]

    def _decode_next(self, token_id: int) -> str:
        assert self._decode is not None
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        window_text = self._decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet, or a character is still incomplete: wait for more tokens.
            return ""
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return new_text

    def _find_stop(self, new_char_count: int) -> str | None:
        """Find the earliest stop string that ends within the last ``new_char_count``
        characters; cut the text there and return it."""
        text = self.output_text
        found: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(len(text) - new_char_count - len(stop) + 1, 0)
            index = text.find(stop, start)
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        self.output_text = text[: index + len(stop)] if self.include_stop_str_in_output else text[:index]
        return stop
