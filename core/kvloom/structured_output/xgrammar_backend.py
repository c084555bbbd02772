"""The built-in structured-output backend, on ``xgrammar`` (the library vLLM uses by
default)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:  # xgrammar loads with the first structured request, not with every engine
    import xgrammar as xgr

from kvloom.sampling_params import StructuredOutputsParams
from kvloom.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar, clean_error

logger = logging.getLogger(__name__)

#: The longest run of whitespace a JSON grammar allows between two JSON tokens. Free
#: whitespace lets a sampled answer spend its whole token budget on blank lines (a tiny
#: probability per step, but nothing ever forces the closing brace); 20 still allows
#: pretty-printed JSON (a newline and the indentation of ten levels of two spaces).
MAX_JSON_WHITESPACE = 20

#: What JSON mode (``json_object``) allows: any JSON object.
ANY_JSON_OBJECT = '{"type": "object"}'


def json_whitespace(params: StructuredOutputsParams) -> dict[str, Any]:
    """xgrammar's whitespace options for a JSON grammar: none between tokens with
    ``disable_any_whitespace`` (compact JSON, as vLLM), else runs of at most
    ``MAX_JSON_WHITESPACE`` characters."""
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def choice_to_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are
    xgrammar's EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema(value: dict[str, Any] | str, field: str) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    try:
        json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.{field} is not valid JSON: {exc}") from None
    return value


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher
        self._num_processed = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                return False
            self._num_processed += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self._num_processed -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()
        self._num_processed = 0

    @property
    def num_processed_tokens(self) -> int:
        return self._num_processed


class XgrammarBackend(StructuredOutputBackend):
    name: ClassVar[str] = "xgrammar"

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        kind = params.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(_schema(params.json, "json"))  # type: ignore[arg-type]
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)  # type: ignore[arg-type]
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)  # type: ignore[arg-type]
            elif kind == "structural_tag":
                tag = params.structural_tag
                xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
            elif kind == "choice":
                xgr.Grammar.from_ebnf(choice_to_ebnf(params.choice))  # type: ignore[arg-type]
        except ValueError:
            raise
        except Exception as exc:  # xgrammar's own errors (RuntimeError subclasses)
            raise ValueError(f"structured_outputs.{kind}: invalid {kind}: {clean_error(exc)[:500]}") from None

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        # The manager caches compiled grammars itself (and counts hits for the metrics).
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        if kind == "json":
            return self.compiler.compile_json_schema(_schema(params.json, "json"), **json_whitespace(params))  # type: ignore[arg-type]
        if kind == "json_object":
            # Not xgrammar's built-in JSON grammar, whose whitespace is unbounded: a schema of
            # any object, properties of any kind allowed (strict_mode off).
            return self.compiler.compile_json_schema(ANY_JSON_OBJECT, strict_mode=False, **json_whitespace(params))
        if kind == "regex":
            return self.compiler.compile_regex(params.regex)  # type: ignore[arg-type]
        if kind == "choice":
            return self.compiler.compile_grammar(choice_to_ebnf(params.choice))  # type: ignore[arg-type]
        if kind == "grammar":
            return self.compiler.compile_grammar(params.grammar)  # type: ignore[arg-type]
        if kind == "structural_tag":
            tag = params.structural_tag
            return self.compiler.compile_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
        raise ValueError(f"structured_outputs: unknown kind {kind!r}")

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        import xgrammar as xgr

        return XgrammarGrammar(xgr.GrammarMatcher(compiled))
